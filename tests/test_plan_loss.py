"""The loss's memory and traffic in `hardy plan train --loss` (hardy's fused chunked loss, torchtitan's
cross-entropy over fp32 logits, and that loss compiled), and published peak memory compared like with like:
reserved by the caching allocator against the planner's live tensors grossed up by a cited margin."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.model.config import ModelConfig
from hardy.ops.compiled_traffic import compiled_traffic
from hardy.ops.kernel_probe import ElementwiseTraffic
from hardy.plan import public_runs
from hardy.plan.arch import arch_from_llama, load_arch
from hardy.plan.hardware import get_hardware
from hardy.plan.memory import ActivationSetup, output_activation_bytes
from hardy.plan.public_runs import GIB, PublicRun, arch_for, memory_comparison, plan_for
from hardy.plan.timing import LLAMA_MODEL_ELEMENTS, LOSS_BYTES_PER_LOGIT, StepSetup, model_elementwise_bytes
from hardy.plan.train import TrainJob, plan_train


def titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss (train.py at 9dec370, components/loss.py at e7c0cae)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def logits(batch=2, seq=48, vocab=1234):
    torch.manual_seed(0)
    return torch.randn(batch, seq, vocab, dtype=torch.bfloat16), torch.randint(0, vocab, (batch, seq))


def saved_bytes(fn, pred, labels) -> int:
    """Bytes of the distinct tensors autograd keeps for the loss's backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(pred.detach().requires_grad_(True), labels)
    return sum(storages.values())


def test_the_full_losss_traffic_per_logit_is_what_its_operators_move():
    pred, labels = logits()
    pred.requires_grad_(True)
    with ElementwiseTraffic() as traffic:
        titan_loss(pred, labels).backward()
    assert traffic.bytes / pred.numel() == pytest.approx(LOSS_BYTES_PER_LOGIT["full"], rel=0.01)


def test_the_compiled_losss_traffic_per_logit_is_what_inductors_kernels_move():
    pred, labels = logits(seq=40, vocab=2000)
    counted = compiled_traffic(titan_loss, pred, labels)
    assert counted.bytes / pred.numel() == pytest.approx(LOSS_BYTES_PER_LOGIT["compiled"], rel=0.03)


@pytest.mark.parametrize("loss", ["full", "compiled"])
def test_the_kept_logit_bytes_are_what_autograd_saves(loss):
    """The planner's kept bytes per logit (the slope of `kept` in the vocabulary) against the tensors the
    loss's backward really holds, eager and compiled."""
    pred, labels = logits()
    fn = titan_loss if loss == "full" else torch.compile(titan_loss)
    measured = saved_bytes(fn, pred, labels) / pred.numel()
    tokens = pred.shape[0] * pred.shape[1]

    def kept(vocab):
        cfg = ModelConfig(vocab_size=vocab, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                          max_seq_len=64, name="t")
        return output_activation_bytes(arch_from_llama(cfg), ActivationSetup(seq=pred.shape[1],
                                                                             micro_batch=pred.shape[0], loss=loss)).kept
    modelled = (kept(2000) - kept(1000)) / (1000 * tokens)
    assert modelled == pytest.approx(measured, rel=0.02)
    assert modelled == (4 if loss == "full" else 2)


def test_output_bytes_by_hand():
    """h = 64, V = 1000, 10 tokens, bf16, TP 2 (vocabulary-parallel loss), no sequence parallelism."""
    cfg = ModelConfig(vocab_size=1000, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
                      name="t")
    arch = arch_from_llama(cfg)
    setup = ActivationSetup(seq=5, micro_batch=2, tp=2)
    final_norm = 10 * (3 * 64 * 2 + 4)
    full = output_activation_bytes(arch, dataclasses.replace(setup, loss="full"))
    assert full == (final_norm + 4 * 10 * 1000 / 2, 8 * 10 * 1000 / 2)
    compiled = output_activation_bytes(arch, dataclasses.replace(setup, loss="compiled"))
    assert compiled == (final_norm + 2 * 10 * 1000 / 2 + 8 * 10 / 2, 2 * 10 * 1000 / 2)
    chunked = output_activation_bytes(arch, setup)  # the fused loss keeps the head's fp32 gradient instead
    assert chunked.kept == 10 * (3 * 64 * 2 + 4) + 4 * 1000 * 64
    # sequence parallel splits the final norm's tensors over the TP ranks too; fp32 keeps 4-byte norms and
    # the same 4 + 8 bytes per logit (the fp32 copy is the logits themselves)
    sp = output_activation_bytes(arch, dataclasses.replace(setup, loss="full", sequence_parallel=True))
    assert sp == (final_norm / 2 + 4 * 10 * 1000 / 2, 8 * 10 * 1000 / 2)
    fp32 = output_activation_bytes(arch, dataclasses.replace(setup, loss="full", precision="fp32"))
    assert fp32 == (10 * (3 * 64 * 4 + 4) + 4 * 10 * 1000 / 2, 8 * 10 * 1000 / 2)


def test_the_loss_changes_the_peak_and_the_step_by_its_formula():
    """Llama 3 8B, 8 H100s, FSDP, no recompute working set (selective-op): the peak grows by the loss's
    kept + transient bytes over the chunked loss's, and the step by its extra traffic at the elementwise rate."""
    job = dict(arch=arch_for("llama3-8b", 8192), hw=get_hardware("h100-sxm"), devices=8, seq=8192,
               global_batch_tokens=16 * 8192, zero=3, micro_batch=2, ac="selective-op")
    plans = {loss: plan_train(TrainJob(**job, loss=loss)) for loss in ("chunked", "full", "compiled")}
    tokens, vocab, h = 16384, 128256, 4096
    norm = tokens * (3 * h * 2 + 4)
    chunk_rows = -(-tokens // -(-tokens // ((1 << 24) // vocab)))
    out = {"chunked": norm + 4 * vocab * h + 8 * chunk_rows * vocab, "full": norm + 12 * tokens * vocab,
           "compiled": norm + 2 * tokens * vocab + 8 * tokens + 2 * tokens * vocab}
    for loss in ("full", "compiled"):
        grown = plans[loss].memory["activations"] - plans["chunked"].memory["activations"]
        assert grown == pytest.approx(out[loss] - out["chunked"])
    assert plans["full"].memory["peak"] > plans["compiled"].memory["peak"] > plans["chunked"].memory["peak"]
    rate = job["hw"].elementwise_rate()
    for loss, per_logit in (("full", 44), ("compiled", 8)):
        extra = plans[loss].step.elementwise_s - plans["chunked"].step.elementwise_s
        assert extra == pytest.approx((per_logit - 8 * 2) * tokens * vocab / rate)  # 1 micro-batch per step
    s = StepSetup(seq=8192, micro_batch=2, micro_batches=1, tp=4, loss="full")
    by_hand = (37 * h * 2 + 44 * vocab / 4) * tokens + LLAMA_MODEL_ELEMENTS["vh_per_microbatch"] * vocab * h / 4 * 2
    assert model_elementwise_bytes(job["arch"], s) == pytest.approx(by_hand)


def test_loss_on_the_command_line_and_its_refusals():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--zero", "3",
            "--seq", "8192", "--json"]
    runs = {loss: hardy_main(*base, *(["--loss", loss] if loss else [])) for loss in (None, "full")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    default, full = (json.loads(runs[k].stdout) for k in (None, "full"))
    assert (default["parallel"]["loss"], full["parallel"]["loss"]) == ("chunked", "full")
    assert full["memory_bytes"]["activations"] > default["memory_bytes"]["activations"]
    text = hardy_main(*base[:-1], "--loss", "compiled")
    assert text.returncode == 0 and "compiled loss over the logits" in text.stdout, text.stderr
    assert "loss over" not in hardy_main(*base[:-1]).stdout  # hardy's own loss is the unnamed default
    gpt = ["plan", "train", "--model", "gpt-22b", "--hardware", "a100-80g", "--devices", "8", "--tp", "8"]
    for loss in ("chunked", "compiled"):
        proc = hardy_main(*gpt, "--loss", loss)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"--loss {loss} is modelled for Llama-family models" in proc.stderr
    assert hardy_main(*gpt, "--loss", "full").returncode == 0
    bad = hardy_main(*base, "--loss", "fused")
    assert bad.returncode == 2 and "invalid choice: 'fused'" in bad.stderr
    with pytest.raises(HardyError, match="--loss must be chunked, full, compiled"):
        plan_train(TrainJob(arch=load_arch("gpt-22b"), hw=get_hardware("a100-80g"), devices=8, seq=2048,
                            global_batch_tokens=8 * 2048, tp=8, loss="fp8"))


def run_with_memory(gib: float) -> PublicRun:
    return PublicRun("torchtitan", "h100-sxm", "llama3-8b", 8, 8192, 2, 1, 5000.0, "selective-op", loss="full",
                     memory_gib=gib)


def test_published_memory_is_compared_as_reserved_against_allocated_with_the_cited_margin():
    allocated = plan_for(run_with_memory(1.0), get_hardware("h100-sxm")).memory["peak"]
    exact = allocated / (1 - 0.15) / GIB  # what the allocator reserves at the cited average fragmentation
    rows = memory_comparison(runs=(run_with_memory(exact), run_with_memory(allocated * 1.6 / GIB),
                                   run_with_memory(allocated * 0.9 / GIB), run_with_memory(allocated * 1.4 / GIB)))
    errors = [r["error"] for r in rows["runs"]]
    assert errors[0] == pytest.approx(0.0, abs=1e-12)
    assert errors[1] == pytest.approx(1 / 0.85 / 1.6 - 1) and errors[2] == pytest.approx(1 / 0.85 / 0.9 - 1)
    # in range: reserved between the live tensors and them at 33% fragmentation (1.49x)
    assert [r["in_cited_range"] for r in rows["runs"]] == [True, False, False, True]
    assert rows["in_cited_range"] == 2 and rows["mape"] == pytest.approx(sum(abs(e) for e in errors) / 4)
    assert all(r["predicted_allocated_bytes"] == pytest.approx(allocated) for r in rows["runs"])


def test_validate_reports_published_memory_by_source():
    report = public_runs.memory_comparison()
    sources = {r["source"] for r in report["runs"]}
    assert sources == {"torchtitan", "trainy-whitefiber"} and len(report["runs"]) == 14
    assert all(r["published_reserved_bytes"] > 40 * GIB for r in report["runs"])
    # the runs' own loss matters: torchtitan's fp32 logits are tens of GiB the fused loss would not hold
    titan = next(r for r in public_runs.RUNS if r.memory_gib == 67.0)
    hw = get_hardware(titan.hardware)
    with_fused = plan_for(dataclasses.replace(titan, loss=None), hw).memory["peak"]
    assert plan_for(titan, hw).memory["peak"] - with_fused > 15 * GIB
