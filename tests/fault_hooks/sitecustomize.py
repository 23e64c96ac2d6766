"""Test-only fault injection for `hardy serve`, loaded by Python at start-up in processes the serving
tests start with this directory on PYTHONPATH (the production engine reads no fault variable).

HARDY_TEST_SERVE_FAULT="prefill@N,decode@M" makes the N-th prefill and the M-th decode pass of rank 0's
model runner raise, as a failing forward pass would (under --tp the other ranks run normally, so they
are left inside that pass's collectives)."""
import os

_SPEC = os.environ.get("HARDY_TEST_SERVE_FAULT", "")

if _SPEC and os.environ.get("RANK", "0") == "0":
    from hardy.serve.engine import ModelRunner

    _faults = set()
    for item in filter(None, _SPEC.split(",")):
        kind, _, n = item.strip().partition("@")
        _faults.add((kind, int(n)))
    _passes = {"prefill": 0, "decode": 0}

    def _failing(kind, method):
        def run(self, *args, **kwargs):
            _passes[kind] += 1
            if (kind, _passes[kind]) in _faults:
                raise RuntimeError(f"injected fault in {kind} pass {_passes[kind]} (HARDY_TEST_SERVE_FAULT)")
            return method(self, *args, **kwargs)
        return run

    ModelRunner.prefill = _failing("prefill", ModelRunner.prefill)
    ModelRunner.decode = _failing("decode", ModelRunner.decode)
