"""`plan train --sp-style dtensor`: sequence parallelism as torchtitan's DTensor plan runs it keeps each
column-parallel linear's all-gathered input (full length) for its weight gradient, where Megatron keeps the
shard and gathers it again. The premise is measured on two gloo processes; the planner's terms by hand."""
from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.model.config import ModelConfig
from hardy.plan.arch import arch_from_llama
from hardy.plan.hardware import get_hardware
from hardy.plan.memory import ActivationSetup, layer_activation_bytes, output_activation_bytes
from hardy.plan.public_runs import arch_for
from hardy.plan.train import TrainJob, plan_train

TOKENS, DIM, FFN = 128, 64, 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _saved_under_dtensor_sp(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        norm, up, down = torch.nn.RMSNorm(DIM), torch.nn.Linear(DIM, FFN, bias=False), torch.nn.Linear(FFN, DIM,
                                                                                                         bias=False)
        block = torch.nn.ModuleDict({"norm": norm, "up": up, "down": down})
        parallelize_module(block, mesh, {"norm": SequenceParallel(use_local_output=True),
                                         "up": ColwiseParallel(input_layouts=Shard(1)),
                                         "down": RowwiseParallel(output_layouts=Shard(1))})
        x = torch.randn(1, TOKENS // 2, DIM, requires_grad=True)  # this rank's half of the sequence
        shapes = []

        def pack(t):
            local = t.to_local() if isinstance(t, DTensor) else t
            shapes.append(list(local.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block["down"](torch.relu(block["up"](block["norm"](x))))
        y.sum().backward()  # the backward's collectives complete before the group goes
        dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                json.dump(shapes, f)
    finally:
        dist.destroy_process_group()


def test_dtensor_sequence_parallel_keeps_the_gathered_input_of_a_column_parallel_linear(tmp_path):
    out = tmp_path / "saved.json"
    mp.spawn(_saved_under_dtensor_sp, args=(_free_port(), str(out)), nprocs=2, join=True)
    shapes = json.loads(out.read_text())
    assert [1, TOKENS // 2, DIM] in shapes  # the norm's input: this rank's shard
    gathered = [s for s in shapes if s[-1] == DIM and TOKENS in s]
    assert gathered, shapes  # the up projection's input: the whole sequence, as the planner's dtensor term says


ARCH = arch_from_llama(ModelConfig(vocab_size=1000, dim=DIM, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=FFN,
                                   max_seq_len=256, name="t"))


def setup(**kw) -> ActivationSetup:
    return ActivationSetup(seq=TOKENS, micro_batch=1, tp=4, sequence_parallel=True, precision="bf16", **kw)


def test_the_dtensor_terms_by_hand():
    """TP 4, 128 tokens, h 64, bf16: a layer without recompute keeps the two gathered norm outputs whole
    (2·tokens·h·e instead of a quarter of it); the head its gathered input; selective and op-level recompute
    replay the all-gathers, so they keep nothing more."""
    megatron, dtensor = setup(), setup(sp_style="dtensor")
    grown = 2 * TOKENS * DIM * 2 * (1 - 1 / 4)
    assert layer_activation_bytes(ARCH, dtensor, "none") - layer_activation_bytes(ARCH, megatron, "none") == \
        pytest.approx(grown)
    for mode in ("selective", "selective_op", "full"):
        assert layer_activation_bytes(ARCH, dtensor, mode) == layer_activation_bytes(ARCH, megatron, mode)
    for loss in ("full", "compiled"):
        a, b = (output_activation_bytes(ARCH, dataclasses.replace(s, loss=loss)) for s in (megatron, dtensor))
        assert b.kept - a.kept == pytest.approx(TOKENS * DIM * 2 * (1 - 1 / 4)) and b.transient == a.transient
    # without sequence parallelism there is nothing to gather
    assert layer_activation_bytes(ARCH, dataclasses.replace(dtensor, sequence_parallel=False), "none") == \
        layer_activation_bytes(ARCH, dataclasses.replace(megatron, sequence_parallel=False), "none")


def test_the_plan_grows_by_the_working_set_and_the_head():
    """Llama 3 70B, TP 8 + SP, full recompute, torchtitan's loss over 8,192 tokens. Where the recomputed layer's
    working set is the top (the first stage's forward and backward), it grows by the two gathered inputs; on
    the last stage the loss's transient logits are larger than it, and only the head's gathered input adds."""
    from hardy.plan.train import activation_bytes, check_job

    job = dict(arch=arch_for("llama3-70b", 8192), hw=get_hardware("h100-sxm"), devices=64, seq=8192,
               global_batch_tokens=8 * 8192, tp=8, zero=3, sequence_parallel=True, ac="full", loss="full")
    jobs = TrainJob(**job), TrainJob(**job, sp_style="dtensor")
    (first_m, last_m), (first_d, last_d) = (activation_bytes(j, check_job(j)) for j in jobs)
    gathered = 8192 * 8192 * 2 * (1 - 1 / 8)  # one norm output: tokens x h in bf16, beyond this rank's eighth
    assert first_d - first_m == pytest.approx(2 * gathered)
    assert last_d - last_m == pytest.approx(gathered)
    megatron, dtensor = (plan_train(j) for j in jobs)
    assert dtensor.step.total_s == megatron.step.total_s


def test_a_search_keeps_the_sp_style_where_it_has_sequence_parallelism():
    """`--sp --sp-style dtensor --search`: the style applies to the candidates with TP, and the ones without
    TP are still planned (not refused for lacking sequence parallelism)."""
    from hardy.plan.train import search

    base = TrainJob(arch=arch_for("llama3-8b", 8192), hw=get_hardware("h100-sxm"), devices=16, seq=8192,
                    global_batch_tokens=16 * 8192, tp=2, sequence_parallel=True, sp_style="dtensor")
    plans, _ = search(base, limit=0)
    assert any(p.job.tp == 1 for p in plans)
    assert all(p.job.sp_style == ("dtensor" if p.job.tp > 1 else "megatron") for p in plans)
    assert all(p.job.sequence_parallel == (p.job.tp > 1) for p in plans)


def test_sp_style_on_the_command_line_and_its_refusals():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--tp", "8",
            "--seq", "4096"]
    proc = hardy_main(*base, "--sp", "--sp-style", "dtensor", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parallel"]["sp_style"] == "dtensor"
    assert "sequence parallel (DTensor's)" in hardy_main(*base, "--sp", "--sp-style", "dtensor").stdout
    bad = hardy_main(*base, "--sp-style", "dtensor")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "it needs --sp" in bad.stderr
    with pytest.raises(HardyError, match="--sp-style must be megatron or dtensor"):
        plan_train(TrainJob(arch=arch_for("llama3-8b", 4096), hw=get_hardware("h100-sxm"), devices=8, seq=4096,
                            global_batch_tokens=8 * 4096, tp=8, sequence_parallel=True, sp_style="deepspeed"))
