"""Async tensor parallelism in the training planner (`--async-tp`): sequence parallelism's all-gathers and
reduce-scatters cut into one chunk per TP rank, each chunk's transfer hidden behind the GEMM of the chunk
before it, where inductor's micro-pipeline TP pass fuses them (not the backward's reduce-scatters of QKV's
and gate/up's input gradients, each a sum of matmuls). Hand-worked on Llama 3 8B's projections (per layer:
QKV 4096 x 6144, out 4096 x 4096, gate + up 4096 x 28672, down 14336 x 4096 weights)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import hardy_main
from hardy.plan.hardware import Link, get_hardware
from hardy.plan.public_runs import arch_for
from hardy.plan.timing import StepSetup, async_tp_exposed, ring_allgather, tp_comm_per_layer
from hardy.plan.train import TrainJob, plan_train

ARCH = arch_for("llama3-8b", 8192)
OUT_PROJ = 4096 * 4096  # the smallest of the four projections' weights
SP = StepSetup(seq=8192, micro_batch=1, micro_batches=1, tp=8, sequence_parallel=True)
ASYNC = dataclasses.replace(SP, async_tp=True)


def chunk_seconds(weights: int, rate: float, s: StepSetup = ASYNC) -> float:
    """One TP rank's GEMM on one of its tp chunks: 2 x tokens x weights / tp (its shard) / tp (the chunk)."""
    return 2 * s.tokens * weights / s.tp / s.tp / rate


def link_with_step(seconds: float, s: StepSetup = ASYNC) -> Link:
    """A latency-free link on which one chunk of a layer's activations (tokens x dim in bf16, / tp) moves in
    `seconds`."""
    return Link("test", bandwidth=s.tokens * ARCH.dim * 2 / s.tp / seconds, latency=0.0, efficiency=1.0)


def test_with_no_gemm_to_hide_behind_async_tp_costs_what_sequence_parallel_does():
    link = get_hardware("h100-sxm").intra_node
    assert tp_comm_per_layer(ARCH, ASYNC, link, gemm_rate=float("inf")) == pytest.approx(
        tp_comm_per_layer(ARCH, SP, link))
    assert tp_comm_per_layer(ARCH, SP, link) == pytest.approx(8 * ring_allgather(8192 * 4096 * 2, 8, link))


def test_a_transfer_shorter_than_every_chunks_gemm_is_hidden_entirely_where_the_pass_fuses_it():
    """Every fused collective hides; the backward's two unfused reduce-scatters (QKV's and gate/up's input
    gradients) stay whole: 2 of the layer's 8 collectives."""
    rate = 400e12
    link = link_with_step(0.99 * chunk_seconds(OUT_PROJ, rate))
    assert tp_comm_per_layer(ARCH, ASYNC, link, rate) == pytest.approx(2 * 7 * 0.99 * chunk_seconds(OUT_PROJ, rate))
    assert tp_comm_per_layer(ARCH, SP, link) == pytest.approx(8 * 7 * 0.99 * chunk_seconds(OUT_PROJ, rate))


def test_only_the_transfers_that_outlast_their_chunks_gemm_show():
    """A chunk's transfer 1.25 times the out projection's chunk GEMM: shorter than QKV's (1.5 times it) and
    the MLP's, so of the fused collectives only the out projection's show, 0.25 of a chunk GEMM for each of
    their 7 steps, in the forward (its reduce-scatter) and the backward (its output gradient's all-gather);
    the backward's two unfused reduce-scatters show whole (7 x 1.25 each)."""
    rate = 400e12
    out = chunk_seconds(OUT_PROJ, rate)
    assert chunk_seconds(4096 * 6144, rate) == pytest.approx(1.5 * out)
    link = link_with_step(1.25 * out)
    unfused = 2 * 7 * 1.25 * out
    assert tp_comm_per_layer(ARCH, ASYNC, link, rate) == pytest.approx(2 * 7 * 0.25 * out + unfused)
    # full recompute replays the forward's four collectives, fused as in the forward: the out projection's shows
    full = dataclasses.replace(ASYNC, recompute="full")
    assert tp_comm_per_layer(ARCH, full, link, rate) == pytest.approx(3 * 7 * 0.25 * out + unfused)
    # op-level recompute replays only the two all-gathers (its policy saves the reduce-scatters): both hide here
    op_level = dataclasses.replace(ASYNC, recompute="selective_op")
    assert tp_comm_per_layer(ARCH, op_level, link, rate) == pytest.approx(2 * 7 * 0.25 * out + unfused)
    # twice the link: every fused transfer hides, the unfused two halve
    assert async_tp_exposed(ARCH, ASYNC, 7 * 0.625 * out, 7 * 0.625 * out, rate) == pytest.approx(unfused / 2)


def test_fp8_tensorwise_gathers_in_fp8_and_scatters_in_bf16():
    """torchao's float8 TP: the all-gathers carry fp8 (1 byte), the reduce-scatters bf16. Synchronous: a layer's
    4 of each cost 4 half-size gathers + 4 scatters; async, at a chunk transfer 1.25 times the out projection's
    chunk GEMM, the gathers (0.625 of it) all hide, the out projection's forward scatter shows 0.25 of a chunk
    GEMM per step, and the backward's two unfused scatters show whole."""
    link = get_hardware("h100-sxm").intra_node
    fp8 = dataclasses.replace(SP, fp8="tensorwise")
    nbytes = 8192 * 4096 * 2
    assert tp_comm_per_layer(ARCH, fp8, link) == pytest.approx(
        4 * (ring_allgather(nbytes / 2, 8, link) + ring_allgather(nbytes, 8, link)))
    assert tp_comm_per_layer(ARCH, dataclasses.replace(fp8, fp8="rowwise"), link) == tp_comm_per_layer(ARCH, SP, link)
    rate = 400e12
    out = chunk_seconds(OUT_PROJ, rate)
    async_fp8 = dataclasses.replace(ASYNC, fp8="tensorwise")
    assert tp_comm_per_layer(ARCH, async_fp8, link_with_step(1.25 * out), rate) == pytest.approx(
        7 * 0.25 * out + 2 * 7 * 1.25 * out)


def test_op_level_recompute_replays_the_all_gathers_and_not_the_reduce_scatters():
    """torchtitan's op-level policy saves reduce-scatter outputs but not all-gathers' or all-reduces': its
    backward replays the forward's two all-gathers (with SP) or two all-reduces (without); full recompute
    replays all four; hardy's selective policy none."""
    from hardy.plan.timing import ring_allreduce
    link = get_hardware("h100-sxm").intra_node
    nbytes = 8192 * 4096 * 2
    gather, allreduce = ring_allgather(nbytes, 8, link), ring_allreduce(nbytes, 8, link)
    op_level = dataclasses.replace(SP, recompute="selective_op")
    assert tp_comm_per_layer(ARCH, op_level, link) == pytest.approx((6 + 4) * gather)
    assert tp_comm_per_layer(ARCH, dataclasses.replace(op_level, recompute_fraction=0.5), link) == pytest.approx(
        (5 + 4) * gather)
    assert tp_comm_per_layer(ARCH, dataclasses.replace(SP, recompute="full"), link) == pytest.approx(12 * gather)
    assert tp_comm_per_layer(ARCH, dataclasses.replace(SP, recompute="selective"), link) == pytest.approx(8 * gather)
    no_sp = dataclasses.replace(op_level, sequence_parallel=False)
    assert tp_comm_per_layer(ARCH, no_sp, link) == pytest.approx(6 * allreduce)


def plan(**kw):
    job = TrainJob(arch=ARCH, hw=get_hardware("h100-sxm"), devices=64, seq=8192, global_batch_tokens=64 * 8192,
                   tp=8, zero=1, sequence_parallel=True, **kw)
    return plan_train(job)


def test_async_tp_takes_the_hidden_tp_time_out_of_the_step():
    """8-way TP on NVLink: the gate + up projection's chunk GEMM outlasts its transfer, the other three do
    not (a transfer takes dim x 2 / NVLink's rate, a chunk's GEMM 2 x weights / tp / the GEMM rate, both per
    token). Forward: QKV's gather, out's and down's scatters show their excess; backward: out's and down's
    gathers their excess, and the two unfused scatters whole. The step loses the hidden part; its GEMMs stay;
    DDP's reduction, hidden behind a shorter last backward, shows more."""
    hw = get_hardware("h100-sxm")
    rate = hw.gemm_rate("bf16", ARCH.dim)
    link = hw.intra_node
    step = ring_allgather(8192 * 4096 * 2, 8, link) / 7
    assert chunk_seconds(4096 * 28672, rate) > step > chunk_seconds(14336 * 4096, rate)
    sync, overlapped = plan().step, plan(async_tp=True).step
    hidden = 1 - tp_comm_per_layer(ARCH, ASYNC, link, rate) / tp_comm_per_layer(ARCH, SP, link)
    excess = {w: step - chunk_seconds(w, rate) for w in (OUT_PROJ, 4096 * 6144, 14336 * 4096)}
    forward = excess[4096 * 6144] + excess[OUT_PROJ] + excess[14336 * 4096]
    backward = excess[OUT_PROJ] + excess[14336 * 4096] + 2 * step
    assert hidden == pytest.approx(1 - (forward + backward) / (8 * step))
    assert overlapped.tp_comm_s == pytest.approx((1 - hidden) * sync.tp_comm_s)
    assert overlapped.compute_s == sync.compute_s and overlapped.elementwise_s == sync.elementwise_s
    assert overlapped.dp_comm_s > sync.dp_comm_s
    assert overlapped.total_s < sync.total_s


def test_async_tp_on_the_command_line():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--tp", "8"]
    sync = hardy_main(*base, "--sp", "--json")
    overlapped = hardy_main(*base, "--sp", "--async-tp", "--json")
    assert sync.returncode == overlapped.returncode == 0, sync.stderr + overlapped.stderr
    sync, overlapped = json.loads(sync.stdout), json.loads(overlapped.stdout)
    assert (sync["parallel"]["async_tp"], overlapped["parallel"]["async_tp"]) == (False, True)
    assert overlapped["step_time_s"]["tp_comm_s"] < sync["step_time_s"]["tp_comm_s"]
    text = hardy_main(*base, "--sp", "--async-tp")
    assert text.returncode == 0 and "sequence parallel, async TP" in text.stdout
    for bad, why in (([], "got --tp 8, no --sp"), (["--tp", "1", "--sp"], "got --tp 1, --sp")):
        proc = hardy_main(*base, *bad, "--async-tp")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "--async-tp overlaps sequence parallelism's all-gathers and reduce-scatters" in proc.stderr
        assert why in proc.stderr


def test_a_search_with_async_tp_applies_it_wherever_it_tries_tensor_parallelism():
    from hardy.plan.train import search

    base = TrainJob(arch=ARCH, hw=get_hardware("h100-sxm"), devices=16, seq=8192, global_batch_tokens=16 * 8192,
                    async_tp=True)
    plans, tried = search(base, limit=0)
    with_tp = [p for p in plans if p.job.tp > 1]
    assert with_tp and all(p.job.async_tp and p.job.sequence_parallel for p in with_tp)
    assert all(not p.job.async_tp for p in plans if p.job.tp == 1)
