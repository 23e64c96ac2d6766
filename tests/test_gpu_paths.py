"""The logic of hardy's GPU paths, tested where a CPU can test it (the `cuda` tier, tests/test_cuda.py,
checks the rest on a GPU): one read-back per training step, fp16 loss scaling applied before
rounding, FSDP2 CPU offload, world-size-1 wrappers, device choice and its errors, the CPU-only
kernels refusing other devices, waits longer than a collective's timeout, CUDA settings."""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from conftest import hardy_main
from trainutil import in_process, launch, read_records, rel_close, step_losses


# ---------------------------------------------------------------- the training step

def test_the_step_reads_back_from_the_device_once(tmp_path, micro_dataset, monkeypatch):
    """Every read of a tensor's value into Python (item, tolist, float(), .cpu(), ...) stalls a GPU until
    its queue drains. hardy's own code in the step does it exactly once (loss, gradient norm, overflow
    flag and scale together), whatever the gradient accumulation."""
    from hardy.train import trainer as trainer_module

    reads = []
    in_step = [False]

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            caller = __import__("sys")._getframe(1).f_globals.get("__name__", "")
            # the data loader is host-side by construction (numpy and a CPU generator's permutation)
            if in_step[0] and caller.startswith("hardy") and caller != "hardy.data.loader":
                reads.append((name, caller))
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    real_step = trainer_module.Trainer.train_step
    per_step = []

    def step(self):
        in_step[0] = True
        before = len(reads)
        try:
            return real_step(self)
        finally:
            in_step[0] = False
            per_step.append(reads[before:])

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step)
    in_process(tmp_path / "run", micro_dataset, "train.steps=3", "train.grad_accum=3")
    assert per_step == [[("tolist", "hardy.train.trainer")]] * 3, per_step


class _Stream:
    """A CUDA stream as the step timer meets it: events happen when the work queued before them has run,
    which a read-back waits for; reading an event that has not happened raises (as CUDA's does)."""

    def __init__(self):
        self.queued, self.ran, self.syncs = 0.0, 0.0, []  # seconds of GPU work queued / run

    def work(self, seconds: float) -> None:
        self.queued += seconds

    def read_back(self) -> None:
        self.ran = self.queued

    def event_class(stream):
        class Event:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing
                self.at = None

            def record(self):
                self.at = stream.queued

            def elapsed_time(self, end) -> float:
                assert self.at is not None and end.at is not None and max(self.at, end.at) <= stream.ran, \
                    "an event read before it happened: CUDA would raise or the host would have to wait"
                return 1000 * (end.at - self.at)

            def synchronize(self):
                stream.syncs.append("Event.synchronize")
                stream.ran = stream.queued

            def query(self):
                stream.syncs.append("Event.query")
                return self.at is not None and self.at <= stream.ran

            def wait(self, *args):
                stream.syncs.append("Event.wait")

        return Event


def test_gpu_step_time_needs_no_synchronization_of_its_own(monkeypatch):
    """On CUDA a step's time comes from events that the step's one read-back has already waited for:
    the timer itself never synchronizes. Consecutive steps' windows tile the GPU's work (each step's
    optimizer tail lands in the next window); after a pause (a save between steps) the next window
    starts at that step's own start, so the host's time outside the steps is nobody's step time."""
    from hardy.train.timing import StepTimer

    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", stream.event_class())
    timer = StepTimer(torch.device("cuda"))
    times = []
    for step, (work, tail) in enumerate([(0.5, 0.125), (0.75, 0.25), (1.0, 0.125), (0.5, 0.25)], start=1):
        timer.start()
        stream.work(work)  # forward, backward, the all-reduce
        timer.mark()
        stream.read_back()  # loss, norm and flags: the step's one wait for the GPU
        stream.work(tail)  # the optimizer step, queued after the read-back
        times.append(timer.stop())
        if step == 2:
            timer.pause()
            stream.work(3.0)  # a checkpoint between steps
    assert stream.syncs == []
    assert times == [0.5, 0.125 + 0.75, 1.0, 0.125 + 0.5]


def test_fused_loss_in_fp16_applies_the_scale_before_rounding():
    """A head whose gradients lie below fp16's normal range unscaled (weights 1e-3 of the usual,
    4,096 tokens: grad_h ~ 1e-7): with the loss scale arriving as the incoming gradient, the fp16
    gradients match float64's. Dividing by the token count in fp16 first loses them to underflow."""
    import hardy.model.loss as L

    torch.manual_seed(0)
    n, d, vocab, scale = 4096, 64, 512, 65536.0
    h64 = torch.randn(n, d, dtype=torch.float64)
    w64 = torch.randn(vocab, d, dtype=torch.float64) * 1e-3
    t = torch.randint(0, vocab, (n,))
    h_ref, w_ref = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    (torch.nn.functional.cross_entropy(h_ref @ w_ref.t(), t) * scale).backward()
    h16, w16 = h64.half().requires_grad_(), w64.half().requires_grad_()
    old, L._MAX_CHUNK_ELEMENTS = L._MAX_CHUNK_ELEMENTS, 1 << 19  # several chunks
    try:
        loss = L.linear_cross_entropy(h16, w16, t)
        (loss * scale).backward()
    finally:
        L._MAX_CHUNK_ELEMENTS = old
    assert abs(loss.item() - math.log(vocab)) < 0.01

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert h_ref.grad.abs().median() < 6e-5 * scale / 16  # the unscaled gradient is subnormal in fp16
    assert rel(h16.grad, h_ref.grad) < 5e-3, rel(h16.grad, h_ref.grad)
    assert rel(w16.grad, w_ref.grad) < 5e-3, rel(w16.grad, w_ref.grad)


def test_fsdp_fp16_tracks_fp32_on_two_processes(tmp_path, micro_dataset):
    """FSDP2 with fp16 parameters (MixedPrecisionPolicy) and torch's ShardedGradScaler on 2 processes,
    against fp32: after one AdamW step (≈ lr·sign(g) per weight, so any lost gradient shows as a
    missing update) the weights agree almost everywhere. The case is built to underflow: 4,096 tokens
    per rank per micro-batch; without a loss scale fp16 loses tens of times more updates."""
    from hardy.loading.load import load_model

    sets = ["parallel.dp_shard=2", "data.seq_len=256", "train.micro_batch=16", "train.steps=1",
            "optim.warmup_steps=0", "checkpoint.at_end=true", "train.peak_tflops=1"]  # no matmul probe

    def weights(name, *extra):
        launch(tmp_path / name, micro_dataset, 2, *sets, *extra)
        return {k: v.clone() for k, v in load_model(str(tmp_path / name)).model.state_dict().items()}

    ref = weights("fp32")
    lr = next(r["lr"] for r in read_records(tmp_path / "fp32") if r["event"] == "step")

    def missed(w):  # share of weights whose first update differs from fp32's by more than half a step
        bad = sum(int(((w[k] - ref[k]).abs() > lr / 2).sum()) for k in ref)
        return bad / sum(v.numel() for v in ref.values())

    scaled = weights("fp16", "precision.dtype=fp16")
    unscaled = weights("fp16_unscaled", "precision.dtype=fp16", "precision.loss_scale=1")
    step = next(r for r in read_records(tmp_path / "fp16") if r["event"] == "step")
    assert not step["skipped"] and step["loss_scale"] == 65536.0
    assert missed(scaled) < 1e-3, missed(scaled)
    assert missed(unscaled) > 10 * max(missed(scaled), 1e-4), (missed(unscaled), missed(scaled))


# ---------------------------------------------------------------- wrappers and offload

@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    from hardy.parallel import distributed as D

    D.init_distributed("gloo", single_group=True)
    yield
    if dist.is_initialized():
        D.destroy()


def test_cpu_offload_materializes_in_host_memory_under_the_policy(one_rank_group):
    """FSDP2's CPUOffloadPolicy needs the sharded parameters in host memory: they are allocated there
    whatever the compute device (here `meta`, which stands for a GPU: nothing is allocated on it),
    and every FSDP unit runs under the policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from hardy.model.config import get_preset
    from hardy.model.transformer import Transformer
    from hardy.parallel.dims import ParallelDims
    from hardy.parallel.parallelize import assign_full_state, build_mesh, parallelize

    dims = ParallelDims.build(1)
    mesh = build_mesh(dims, "cpu", "fsdp")

    def build(offload):
        with torch.device("meta"):
            model = Transformer(get_preset("micro"))

        def materialize(m, device):
            assign_full_state(m, m.initial_state(0))
            m.reset_rope(64, device=device)

        return parallelize(model, dims, mesh, torch.device("meta"), materialize, cpu_offload=offload, wrap="fsdp")

    model = build(True)
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
    assert model.rope_cos.device.type == "meta"  # the forward's tables sit on the compute device
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    assert len(units) == len(model.layers) + 1
    for unit in units:
        assert isinstance(unit._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    plain = build(False)
    assert {p.to_local().device.type for p in plain.parameters()} == {"meta"}


def test_offload_and_wrapper_choices_are_validated():
    from hardy.errors import HardyError
    from hardy.parallel.dims import ParallelDims
    from hardy.parallel.parallelize import parallelize, wrapping

    one, two = ParallelDims.build(1), ParallelDims.build(2, dp_shard=2)
    assert wrapping(one) is None and wrapping(one, "fsdp") == "fsdp" and wrapping(one, "ddp") == "ddp"
    assert wrapping(two) == "fsdp" and wrapping(ParallelDims.build(2)) == "ddp"
    with pytest.raises(HardyError, match="cannot shard"):
        wrapping(two, "ddp")
    with pytest.raises(HardyError, match="cpu_offload is FSDP2's"):
        parallelize(None, one, None, torch.device("cpu"), None, cpu_offload=True)


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_world_size_one_goes_through_the_wrappers(tmp_path, micro_dataset, wrap):
    """One process with a one-rank group: DDP or FSDP2 (mixed-precision policy, offload) run the same
    step as a multi-device job, and train exactly like the unwrapped model."""
    in_process(tmp_path / "plain", micro_dataset, "train.steps=3")
    in_process(tmp_path / wrap, micro_dataset, "train.steps=3", f"parallel.wrap={wrap}",
               *(["parallel.cpu_offload=true"] if wrap == "fsdp" else []))
    assert rel_close(step_losses(tmp_path / wrap), step_losses(tmp_path / "plain"), 1e-5)
    start = next(r for r in read_records(tmp_path / wrap) if r["event"] == "start")
    assert start["config"]["parallel"]["wrap"] == wrap


# ---------------------------------------------------------------- devices

def test_device_choice(monkeypatch):
    from hardy.devices import check_cuda_index, resolve_device
    from hardy.errors import HardyError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    with pytest.raises(HardyError, match="no CUDA device is visible"):
        resolve_device("cuda")
    with pytest.raises(HardyError, match="expected cpu, cuda"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("auto", quantized=True) == torch.device("cpu")  # the int4/int8 kernels are CPU code
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(HardyError, match=r"cuda:1 was asked for, but 1 CUDA device"):
        check_cuda_index(1)  # e.g. a second local rank on a one-GPU machine


def test_probe_allreduce_never_asks_for_a_missing_gpu():
    from hardy.ops.probe import allreduce_backend

    assert allreduce_backend(0, 2) == ("gloo", "")
    backend, note = allreduce_backend(1, 2)
    assert backend == "gloo" and "NCCL needs one each" in note
    assert allreduce_backend(8, 2) == ("nccl", "")


def test_cuda_settings_for_determinism_and_tf32(monkeypatch):
    from hardy.devices import CUBLAS_DETERMINISTIC, configure_cuda

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32)
    try:
        notes = configure_cuda(deterministic=True, tf32=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC
        assert cudnn.deterministic and not cudnn.benchmark
        assert matmul.allow_tf32 and cudnn.allow_tf32 and "TF32 matmul on" in notes
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice is kept
        notes = configure_cuda(deterministic=True, tf32=False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and not matmul.allow_tf32
        assert any("true fp32" in n for n in notes)
    finally:
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved


@pytest.mark.parametrize("args", [
    ["generate", "--model", "smollm2-135m", "--prompt", "hi", "--device", "cuda"],
    ["eval", "perplexity", "--model", "smollm2-135m", "--data", "tinyshakespeare", "--device", "cuda:0"],
    ["compress", "--model", "smollm2-135m", "--out", "x", "--quant", "rtn", "--device", "cuda"],
    ["serve", "--model", "smollm2-135m", "--device", "cuda"],
    ["generate", "--model", "smollm2-135m", "--prompt", "hi", "--tp", "2", "--device", "cuda"],
])
def test_asking_for_cuda_without_one_is_a_one_line_error(args, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    proc = hardy_main(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hardy: error:"), proc.stderr
    assert ("CUDA" in lines[0] or "--tp" in lines[0]), lines[0]


def test_launch_refuses_more_processes_than_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (tmp_path / "c.toml").write_text("")
    proc = hardy_main("launch", "--nproc", "2", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "--nproc 2 on a machine with 1 visible GPU" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before any process started
    proc = hardy_main("launch", "--nproc", "2", str(tmp_path / "c.toml"), "--set", "parallel.wrap=ddp",
                      "--set", "parallel.dp_shard=2", "--set", "parallel.backend=gloo")
    assert proc.returncode == 2 and "cannot shard" in proc.stderr, proc.stderr


def test_quantized_kernels_refuse_tensors_off_the_cpu():
    """The C++ kernels read host memory through data pointers: any other device is refused by name,
    and a quantized layer moved off the CPU drops them for PyTorch's path."""
    from hardy.compress import kernels
    from hardy.compress.qlinear import QuantLinear
    from hardy.formats.quantized import QuantSpec, rtn

    module = kernels.load()
    assert module is not None, "the kernels build on every x86-64 machine hardy runs on"
    layer = QuantLinear(rtn(torch.randn(64, 64), QuantSpec(bits=8, group_size=32)))
    kernels.prepare(torch.nn.Sequential(layer))
    assert layer.kernel is not None
    x = torch.randn(1, 64)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight())
    assert (layer(x) - expected).norm() / expected.norm() < 2e-2  # int8 activations: llama.cpp's method
    with pytest.raises(RuntimeError, match="run on the CPU, but the input has a tensor on meta"):
        module.qgemv(x.to("meta"), *kernels.kernel_tensors(layer), 32, 64)
    with pytest.raises(RuntimeError, match="quantized matrix has a tensor on meta"):
        module.qgemv(x, layer.qweight.to("meta"), layer.scales, kernels.kernel_tensors(layer)[2], 32, 64)
    layer.to("meta")
    assert layer.kernel is None


# ---------------------------------------------------------------- waits longer than a collective

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, fail: bool, out) -> None:
    import time

    import torch.distributed as dist

    from hardy.errors import HardyError
    from hardy.parallel import distributed as D

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    D.init_distributed("gloo", timeout_s=2.0)

    def work():
        time.sleep(4.0)  # longer than the group's 2 s collective timeout
        if fail:
            raise HardyError("corpus.txt: not UTF-8 text")
        return "prepared"

    try:
        result = D.main_rank_does("prepare", work, rank, timeout_s=60)
        dist.barrier()  # the group is still usable afterwards
        out.put((rank, "ok", result))
    except HardyError as e:
        out.put((rank, "error", str(e)))
    finally:
        if not fail:
            D.destroy()


@pytest.mark.parametrize("fail", [False, True])
def test_rank0_work_is_awaited_on_the_store_not_in_a_collective(fail):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, fail, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    if fail:  # rank 0's one-line error reaches rank 1 instead of a timeout
        assert results == [(0, "error", "corpus.txt: not UTF-8 text"), (1, "error", "corpus.txt: not UTF-8 text")]
    else:
        assert results == [(0, "ok", "prepared"), (1, "ok", None)]
