"""`hardy plan serve`: the serving planner's formulas against hand computation, and its CLI errors."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_hardy
from hardy.errors import HardyError
from hardy.model.config import PRESETS, count_parameters
from hardy.plan.hardware import hardware_from_dict
from hardy.plan.serve import kv_bytes_per_token, plan_serve, weight_bytes

SMOL, L8B, L405B = PRESETS["smollm2-135m"], PRESETS["llama3.1-8b"], PRESETS["llama3.1-405b"]

GPU = {"kind": "gpu", "peak_tflops": {"fp32": 100.0, "bf16": 400.0}, "memory_gb": 80.0, "bandwidth_gbs": 2000.0,
       "flops_efficiency": 0.5, "bandwidth_efficiency": 0.8, "devices_per_node": 8,
       "intra_node": {"name": "nvlink", "bandwidth_gbs": 400.0, "latency_us": 5.0, "efficiency": 0.75},
       "inter_node": {"name": "ib", "bandwidth_gbs": 50.0, "latency_us": 10.0}, "price_per_device_hour": 2.0,
       "op_overhead_us": 0.0}  # dispatch has its own test
L40S_LIKE = dict(GPU, memory_gb=48.0, bandwidth_gbs=864.0, peak_tflops={"fp32": 91.6, "bf16": 362.0})


def hw(**changes):
    return hardware_from_dict("test-gpu", dict(GPU, **changes))


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(SMOL) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(L8B) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(L8B, "fp32") == 2 * 131_072
    plan = plan_serve(SMOL, hw(), quant="fp32", context=1024)
    assert plan.kv_dtype == "fp32" and plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert plan.kv_bytes_per_sequence_per_device == 2 * 30 * 3 * 64 * 4 * 1024


def test_quantized_weight_bytes_include_group_overhead():
    counts = count_parameters(L8B)
    quantized, norms = counts.total - counts.norms, counts.norms
    assert weight_bytes(L8B, "fp16") == 2 * counts.total
    assert weight_bytes(L8B, "int8") == quantized * (1 + 2 / 32) + 2 * norms  # fp16 scale per 32
    assert weight_bytes(L8B, "int4") == quantized * (0.5 + 4 / 32) + 2 * norms  # fp16 scale + zero per 32
    assert weight_bytes(L8B, "int4") < weight_bytes(L8B, "int8") < weight_bytes(L8B, "fp16")
    assert weight_bytes(SMOL, "fp32") == 4 * count_parameters(SMOL).total  # tied: stored once


def test_decode_at_batch_1_is_bandwidth_bound():
    h = hw()
    plan = plan_serve(SMOL, h, quant="fp32", context=512, prompt_tokens=8, output_tokens=128, batch=1)
    # every weight once (the tied embedding is read as the LM head) + the KV cache at the average context
    step_bytes = 4 * 134_515_008 + 2 * 30 * 3 * 64 * 4 * (8 + 128 / 2)
    assert plan.bound == "memory bandwidth"
    assert plan.step_bytes_per_device == pytest.approx(step_bytes)
    assert plan.decode_tokens_per_s == pytest.approx(2000e9 * 0.8 / step_bytes)
    assert plan.step_allreduce_s == 0
    assert plan.prefill_s > 0 and plan.request_latency_s == pytest.approx(plan.prefill_s + 127 * plan.step_s)
    hours = plan.request_latency_s / 3600
    assert plan.cost_per_million_tokens == pytest.approx(2.0 * hours / 128 * 1e6)


def test_large_batch_turns_compute_bound():
    big = hw(memory_gb=100_000.0)
    small = plan_serve(L8B, big, context=256, prompt_tokens=64, output_tokens=64, batch=1)
    large = plan_serve(L8B, big, context=256, prompt_tokens=64, output_tokens=64, batch=4096)
    assert small.bound == "memory bandwidth" and large.bound == "compute"
    assert large.step_s == pytest.approx(large.step_flops_per_device / (400e12 * 0.5))
    assert large.decode_tokens_per_s_batch > 100 * small.decode_tokens_per_s_batch


def test_dispatch_adds_on_cpu_and_hides_behind_gpu_kernels():
    ops = 30 * 30 + 20  # operators per forward of SmolLM2's 30 layers
    kw = dict(quant="fp32", context=512, prompt_tokens=8, output_tokens=128)
    base = plan_serve(SMOL, hw(), **kw)
    cpu = plan_serve(SMOL, hw(kind="cpu", op_overhead_us=2.0), **kw)
    assert cpu.step_dispatch_s == pytest.approx(ops * 2e-6)
    assert cpu.step_s == pytest.approx(base.step_s + ops * 2e-6)
    gpu = plan_serve(SMOL, hw(op_overhead_us=2.0), **kw)  # 1.8 ms of launches vs 0.42 ms of streaming
    assert gpu.step_s == pytest.approx(ops * 2e-6) and gpu.bound == "dispatch"
    big = plan_serve(L8B, hw(op_overhead_us=2.0), batch=1)  # 10 ms of streaming hides the launches
    assert big.step_dispatch_s == 0 and big.bound == "memory bandwidth"


def test_largest_batch_fits_and_one_more_does_not():
    h = hw()
    plan = plan_serve(L8B, h, context=4096)
    usable = 80e9 * 0.9
    need = lambda b: plan.weight_bytes_per_device + b * plan.kv_bytes_per_sequence_per_device  # noqa: E731
    assert need(plan.max_batch) <= usable < need(plan.max_batch + 1)
    assert plan_serve(L8B, h, context=4096, batch=plan.max_batch).batch == plan.max_batch
    with pytest.raises(HardyError, match=f"largest batch at context 4096 is {plan.max_batch}"):
        plan_serve(L8B, h, context=4096, batch=plan.max_batch + 1)


def test_tensor_parallel_halves_weights_and_adds_allreduce():
    h = hw()
    one = plan_serve(L8B, h, batch=8)
    two = plan_serve(L8B, h, devices=2, batch=8)
    norms = count_parameters(L8B).norms * 2  # replicated on every device
    assert two.weight_bytes_per_device - norms == pytest.approx((one.weight_bytes_per_device - norms) / 2)
    assert two.kv_bytes_per_sequence_per_device == one.kv_bytes_per_sequence_per_device / 2
    # 2 all-reduces per layer of batch x dim bf16 activations on the in-node link (ring of 2: 2 hops)
    per = 2 * 5e-6 + 2 * (2 - 1) / 2 * 8 * 4096 * 2 / (400e9 * 0.75)
    assert one.step_allreduce_s == 0 and two.step_allreduce_s == pytest.approx(2 * 32 * per)
    assert two.step_s < one.step_s and two.max_batch > one.max_batch


def test_kv_heads_replicate_beyond_n_kv():
    plan = plan_serve(L8B, hw(), devices=16)
    assert plan.kv_heads_per_device == 1 and plan.kv_replicated
    assert any("replicated" in n for n in plan.notes)


def test_qps_little_law():
    h = hw()
    plan = plan_serve(L8B, h, qps=5.0)
    assert plan.qps_sustained and plan.requests_per_s >= 5.0
    assert 5.0 * plan.request_latency_s <= plan.batch
    if plan.batch > 1:  # the smallest such batch
        assert plan_serve(L8B, h, batch=plan.batch - 1).requests_per_s < 5.0
    impossible = plan_serve(L8B, h, qps=1e6)
    assert not impossible.qps_sustained and impossible.batch == impossible.max_batch
    assert "cannot sustain" in impossible.notes[-1]


def test_405b_does_not_fit_on_one_l40s():
    l40s = hardware_from_dict("l40s-like", L40S_LIKE)
    with pytest.raises(HardyError) as e:
        plan_serve(L405B, l40s)
    msg = str(e.value)
    short = (weight_bytes(L405B, "fp16") + kv_bytes_per_token(L405B) * 2048 - 48e9 * 0.9) / 1e9
    assert f"short by {short:,.2f} GB" in msg
    assert "32 devices (tensor parallel)" in msg  # 16 × 50.7 GB does not fit, 32 × 25.4 GB does
    assert "int8 on 16 devices" in msg and "int4 on 8 devices" in msg
    plan_serve(L405B, l40s, devices=32)  # and it really does


@pytest.mark.parametrize("kwargs, fragment", [
    ({"quant": "int3"}, "unknown quant"), ({"devices": 0}, "--devices must be >= 1"),
    ({"devices": 3}, "divisible by 3"), ({"prompt_tokens": 4000}, "must fit the context"),
])
def test_invalid_inputs(kwargs, fragment):
    with pytest.raises(HardyError, match=fragment):
        plan_serve(L8B, hw(), **kwargs)


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    def table(name, d):
        lines = [f"[hardware.{name}]", f'kind = "{d["kind"]}"', f'memory_gb = {d["memory_gb"]}',
                 f'bandwidth_gbs = {d["bandwidth_gbs"]}', f'flops_efficiency = {d["flops_efficiency"]}',
                 f'bandwidth_efficiency = {d["bandwidth_efficiency"]}', f'devices_per_node = {d["devices_per_node"]}',
                 f'price_per_device_hour = {d["price_per_device_hour"]}', f'op_overhead_us = {d["op_overhead_us"]}',
                 "peak_tflops = {" + ", ".join(f"{k} = {v}" for k, v in d["peak_tflops"].items()) + "}"]
        for link in ("intra_node", "inter_node"):
            lines.append(f"{link} = {{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d[link].items()) + "}")
        return "\n".join(lines) + "\n"

    path = tmp_path_factory.mktemp("cat") / "catalogue.toml"
    path.write_text(table("test-gpu", GPU) + "\n" + table("l40s-like", L40S_LIKE))
    return path


def test_cli_json(catalogue):
    proc = run_hardy("plan", "serve", "--model", "llama3.1-8b", "--hardware", "test-gpu", "--catalogue",
                     str(catalogue), "--devices", "2", "--quant", "int4", "--qps", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = plan_serve(L8B, hardware_from_dict("test-gpu", GPU), devices=2, quant="int4", qps=3.0)
    for key, value in want.to_dict().items():
        assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), key


@pytest.mark.parametrize("args, fragment", [
    (["--model", "llama3.1-405b", "--hardware", "l40s-like"], "short by"),
    (["--model", "llama3.1-8b", "--hardware", "test-gpu", "--devices", "3"], "divisible by 3"),
    (["--model", "llama3.1-8b", "--hardware", "nope"], "unknown hardware 'nope'"),
    (["--model", "llama3.1-8b", "--hardware", "test-gpu", "--quant", "int3"], "invalid choice"),
])
def test_cli_errors_are_one_line(catalogue, args, fragment):
    proc = run_hardy("plan", "serve", *args, "--catalogue", str(catalogue))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hardy: error: ") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_files_own_bytes_and_the_quantized_kernel_rate():
    """--quant file: a step reads the file's matrices and head as hardy holds them (not one uniform
    format), at the rate the probe measured for hardy's int4 kernel where it has one."""
    import dataclasses

    from hardy.plan.weights import WeightLayout

    layout = WeightLayout(matmul_bytes=3.9e9, head_bytes=0.3e9, embedding_bytes=0.3e9, norm_bytes=1e6,
                          types="Q4_0 x 226", quantized=True)
    cpu = hw(kind="cpu", op_overhead_us=0.0)
    kw = dict(context=552, prompt_tokens=512, output_tokens=32, batch=1)
    plan = plan_serve(L8B, cpu, quant="file", layout=layout, **kw)
    kv = 2 * 32 * 8 * 128 * 4 * (512 + 16)  # fp32 KV (hardy's CPU cache) at the average context
    assert plan.kv_dtype == "fp32" and plan.weight_bytes == pytest.approx(layout.total)
    assert plan.step_bytes_per_device == pytest.approx(3.9e9 + 0.3e9 + 1e6 + kv)
    assert plan.step_memory_s == pytest.approx(plan.step_bytes_per_device / (2000e9 * 0.8))
    fast = plan_serve(L8B, dataclasses.replace(cpu, quantized_decode_bandwidth=25e9), quant="file", layout=layout, **kw)
    assert fast.step_memory_s == pytest.approx(fast.step_bytes_per_device / 25e9)
    fp16 = plan_serve(L8B, dataclasses.replace(cpu, quantized_decode_bandwidth=25e9), quant="fp16", **kw)
    assert fp16.step_memory_s == pytest.approx(fp16.step_bytes_per_device / (2000e9 * 0.8))  # not the kernels
    two = plan_serve(L8B, cpu, devices=2, quant="file", layout=layout, **kw)
    assert two.weight_bytes_per_device == pytest.approx(3.9e9 / 2 + 0.3e9 / 2 + 0.3e9 / 2 + 1e6)
    with pytest.raises(HardyError, match="quant file"):
        plan_serve(L8B, cpu, quant="file", **kw)


def test_cli_plans_a_quantized_gguf_as_the_file_holds_it(smollm2_path):
    from hardy.plan.weights import layout_from_gguf

    proc = run_hardy("plan", "serve", "--model", str(smollm2_path), "--hardware", "xeon-spr", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    layout = layout_from_gguf(smollm2_path)
    assert plan["quant"] == "file" and plan["weight_bytes"] == pytest.approx(layout.total)
    assert "Q4_1" in layout.types and "Q8_0" in layout.types  # the shipped file's mix
    bad = run_hardy("plan", "serve", "--model", "llama3.1-8b", "--hardware", "xeon-spr", "--quant", "file")
    assert bad.returncode == 2 and "not a GGUF file" in bad.stderr and "Traceback" not in bad.stderr


def test_rerank_flops_match_a_counted_forward_of_the_scoring_pass():
    """The planner's FLOPs per query against torch's FlopCounterMode on the real scoring pass (micro
    model, 6 candidates of 40 + 8 tokens): matmuls, attention and the head at the query positions."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from hardy.infer.rerank import ScoreRow, batch_tensors, target_log_likelihood
    from hardy.model.config import get_preset
    from hardy.model.transformer import build_model
    from hardy.plan.rerank import plan_rerank

    cfg = get_preset("micro")
    model = build_model(cfg, seed=0).eval()
    k, passage, query = 6, 40, 8
    rows = [ScoreRow(list(range(1, passage + query + 1)), passage, list(range(passage + 1, passage + query + 1)))
            for _ in range(k)]
    # the math backend computes attention as counted matmuls (the fused CPU kernel has no FLOP rule)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        target_log_likelihood(model, *batch_tensors(rows, 0))
    plan = plan_rerank(cfg, hw(), quant="fp32", candidates=k, passage_tokens=passage, query_tokens=query,
                       template_tokens=0, rerank_batch=k)
    # torch counts attention over the full n x n scores; the plan counts the causal half it needs
    n = passage + query
    full_attention_extra = k * 4 * cfg.n_layers * cfg.n_heads * cfg.d_head * (n * n - n * (n + 1) / 2)
    assert plan.flops_per_query_per_device == pytest.approx(counter.get_total_flops() - full_attention_extra, rel=1e-6)


def test_rerank_elementwise_bytes_match_a_counted_block_forward():
    """FORWARD_ELEMENTS against the elements hardy's transformer block really reads and writes outside
    its matmuls and attention (every operator of a block's forward seen at dispatch; views move nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from hardy.model.config import get_preset
    from hardy.model.transformer import build_model
    from hardy.plan.rerank import forward_elements_per_token

    not_elementwise = {"linear", "mm", "addmm", "bmm", "scaled_dot_product_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "to", "_to_copy"}  # .to(same dtype): no copy
    views = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "slice", "select", "unsqueeze",
             "reshape", "detach", "alias", "permute", "squeeze", "split", "unbind", "empty"}

    class Count(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ not in not_elementwise | views:
                self.elements += sum(t.numel() for t in tree_leaves((args, kwargs, out))
                                     if isinstance(t, torch.Tensor) and t.is_floating_point())
            return out

    for preset in ("micro", "smollm2-135m"):
        cfg = get_preset(preset)
        model = build_model(cfg, seed=0).eval()
        model.reset_rope()
        tokens = 40
        with torch.inference_mode(), Count() as count:
            model.layers[0](torch.randn(2, tokens, cfg.dim), model.rotary(0, tokens, torch.float32), 0)
        assert forward_elements_per_token(cfg) == pytest.approx(count.elements / (2 * tokens), rel=0.15), preset


def test_rerank_plan_scales_with_candidates_and_prices_queries():
    from hardy.plan.rerank import plan_rerank

    one = plan_rerank(SMOL, hw(op_overhead_us=0.0), quant="bf16", candidates=10, passage_tokens=100, rerank_batch=10)
    two = plan_rerank(SMOL, hw(op_overhead_us=0.0), quant="bf16", candidates=20, passage_tokens=100, rerank_batch=10)
    assert one.bound == "compute" and two.passes_per_query == 2
    assert two.latency_s == pytest.approx(2 * one.latency_s, rel=1e-9)  # compute-bound: linear in candidates
    assert one.cost_per_million_queries == pytest.approx(2.0 / 3600 * one.latency_s * 1e6)
    assert one.queries_per_s == pytest.approx(1 / one.latency_s)
    tp = plan_rerank(L8B, hw(), quant="bf16", devices=2, candidates=20, passage_tokens=100)
    assert tp.allreduce_s > 0 and tp.weight_bytes_per_device < weight_bytes(L8B, "bf16")
    # measured rates by shape: attention at the head size's, matmuls at the model width's
    import dataclasses

    slow, fast = (dataclasses.replace(hw(op_overhead_us=0.0), attention_efficiency_by_head_dim=((64, a),),
                                      gemm_efficiency_by_width=((576, g),)) for a, g in ((0.1, 0.4), (0.2, 0.8)))
    slow, fast = (plan_rerank(SMOL, h, quant="bf16", candidates=20, passage_tokens=100) for h in (slow, fast))
    assert slow.attention_s == pytest.approx(2 * fast.attention_s) and slow.elementwise_s == fast.elementwise_s
    assert (slow.compute_s - slow.attention_s - slow.elementwise_s == pytest.approx(
        2 * (fast.compute_s - fast.attention_s - fast.elementwise_s)))
    # where a probe measured the inference forward's GEMMs apart from training's, the plan takes those
    forward = dataclasses.replace(hw(op_overhead_us=0.0), attention_efficiency_by_head_dim=((64, 0.2),),
                                  gemm_efficiency_by_width=((576, 0.8),), forward_gemm_efficiency_by_width=((576, 0.4),))
    forward = plan_rerank(SMOL, forward, quant="bf16", candidates=20, passage_tokens=100)
    assert forward.compute_s - forward.attention_s - forward.elementwise_s == pytest.approx(
        2 * (fast.compute_s - fast.attention_s - fast.elementwise_s))
    with pytest.raises(HardyError, match="exceeds"):
        plan_rerank(SMOL, hw(), quant="bf16", passage_tokens=SMOL.max_seq_len)
    with pytest.raises(HardyError, match="--candidates must be >= 1"):
        plan_rerank(SMOL, hw(), quant="bf16", candidates=0)


def test_cli_rerank_workload(catalogue):
    proc = run_hardy("plan", "serve", "--model", "smollm2-135m", "--hardware", "h100-sxm", "--quant", "bf16",
                     "--workload", "rerank", "--candidates", "20", "--passage-tokens", "110", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["candidates"] == 20 and plan["row_tokens"] == 110 + plan["template_tokens"] + plan["query_tokens"]
    assert plan["cost_per_million_queries"] > 0 and plan["queries_per_s"] > 0
    bad = run_hardy("plan", "serve", "--model", "smollm2-135m", "--hardware", "h100-sxm", "--workload", "rerank",
                    "--candidates", "0")
    assert bad.returncode == 2 and "--candidates must be >= 1" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3.1-8b", "llama3.1-405b", "qwen3-30b-a3b"])
def test_kv_and_weight_bytes_are_what_hardy_allocates(name):
    """Against the implementation, not the formula: the bytes per token of the paged KV cache hardy's
    generate and serve allocate for the model (on the meta device: no memory is touched), and the bytes
    of the model's own parameters, a tied embedding counted once."""
    from hardy.infer.kv import PagedKVCache
    from hardy.model.transformer import meta_transformer

    cfg = PRESETS[name]
    model = meta_transformer(cfg)
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        cache = PagedKVCache(model, 1, 64, dtype)
        blocks = cache.pool.blocks
        per_token = blocks.numel() * blocks.element_size() / (blocks.shape[0] * blocks.shape[4])
        assert kv_bytes_per_token(cfg, label) == per_token, (name, label)
        cache.close()
    stored = sum(p.numel() for p in model.parameters())  # a shared (tied) parameter is yielded once
    assert weight_bytes(cfg, "fp32") == 4 * stored and weight_bytes(cfg, "fp16") == 2 * stored
