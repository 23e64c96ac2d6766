"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert) against stock
`transformers` and llama.cpp, and the router's edge cases: ties, norm_topk_prob on and off, experts
no token reaches, every token to one expert."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hardy_main
from families import build_hf_model, byte_level_tokenizer, llama_cpp_greedy, moe_configs
from hardy.formats.gguf_export import export_gguf
from hardy.formats.hf import save_hf_dir
from hardy.infer.generate import SamplingConfig, generate
from hardy.loading.load import load_model
from hardy.model.config import ModelConfig, MoEConfig
from hardy.model.moe import MoE, softmax_topk

transformers = pytest.importorskip("transformers")
FAMILIES = list(moe_configs(transformers))
GREEDY = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (transformers model, the directory it saved)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = build_hf_model(transformers, family)
        model.save_pretrained(path)
        out[family] = (model, path)
    return out


def _tokens(batch=2, seq=24, seed=3):
    return torch.randint(0, 320, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_logits_and_greedy_tokens_equal_transformers(saved, family):
    hf, path = saved[family]
    ours = load_model(str(path))
    assert ours.config.family == family and ours.config.moe is not None
    tokens = _tokens()
    torch.testing.assert_close(ours.model(tokens), hf(tokens).logits, rtol=0, atol=1e-4)
    prompt = _tokens(1, 10, seed=4)
    theirs = hf.generate(prompt, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                         pad_token_id=0)[0, 10:].tolist()
    assert generate(ours.model, prompt[0].tolist(), SamplingConfig(max_new_tokens=GREEDY)).tokens == theirs


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_hardys_export_loads_in_transformers_with_the_same_logits(saved, family, tmp_path):
    ours = load_model(str(saved[family][1]))
    save_hf_dir(ours.config, ours.model.state_dict(), None, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = _tokens()
    torch.testing.assert_close(back(tokens).logits, ours.model(tokens), rtol=0, atol=1e-4)
    assert load_model(str(tmp_path / "out")).config == ours.config


@torch.inference_mode()
def test_the_experts_are_what_the_model_computes(saved):
    """Each family's distinguishing piece switched off moves the logits: the routing (top-k renormalized
    or not), the shared expert and its gate, the dense layer among the MoE ones."""
    tokens = _tokens()
    for family, change in (("qwen3_moe", "norm"), ("qwen2_moe", "shared_gate"), ("mixtral", "expert")):
        ours = load_model(str(saved[family][1]))
        reference = ours.model(tokens)
        block = ours.model.layers[0].feed_forward
        if change == "norm":
            for layer in ours.model.layers:
                if isinstance(layer.feed_forward, MoE):
                    layer.feed_forward.moe = MoEConfig(**{**layer.feed_forward.moe.__dict__, "norm_topk_prob": False})
        elif change == "shared_gate":
            block.shared_gate.weight.zero_()  # sigmoid(0) = 1/2 of the shared expert instead of its gate
        else:
            block.experts[int(block.router(ours.model.embed(tokens)).argmax(-1)[0, 0])].w2.weight.zero_()
        assert (ours.model(tokens) - reference).abs().max() > 1e-3, family


def test_router_ties_go_to_the_lower_expert_and_norm_topk_prob_renormalizes():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, experts = softmax_topk(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2], [0, 1]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(weights, probs.gather(1, experts))
    assert weights.sum(-1).lt(0.99).all()
    normed, same = softmax_topk(logits, 2, normalize=True)
    assert torch.equal(same, experts)
    torch.testing.assert_close(normed.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))
    # the same ties in a bigger batch route the same way (a stable order, not the kernel's whim)
    many = logits.repeat(300, 1)
    assert torch.equal(softmax_topk(many, 2, False)[1], experts.repeat(300, 1))


def _block(top_k=2, n_experts=6, shared=0) -> MoE:
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=24,
                      moe=MoEConfig(n_experts=n_experts, top_k=top_k, ffn_dim=8, shared_ffn_dim=shared,
                                    shared_gate=bool(shared)))
    torch.manual_seed(0)
    block = MoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def _per_token_reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, each of its experts in turn: the definition the grouped forward must meet."""
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        weights, experts = softmax_topk(block.router(token[None]), block.moe.top_k, block.moe.norm_topk_prob)
        y = sum(w * block.experts[int(e)](token) for w, e in zip(weights[0], experts[0]))
        if block.shared is not None:
            y = y + torch.sigmoid(block.shared_gate(token)) * block.shared(token)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@torch.inference_mode()
def test_experts_without_tokens_and_all_tokens_to_one_expert():
    block = _block(shared=12)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    _, experts = softmax_topk(block.router(x.reshape(-1, 16)), 2, True)
    torch.testing.assert_close(block(x), _per_token_reference(block, x), rtol=0, atol=1e-5)
    # every token to expert 4 (and its runner-up): the others receive nothing
    block.router.weight.zero_()
    block.router.weight[4] = 10.0 * x.reshape(-1, 16).mean(0)
    block.router.weight[1] = 5.0 * x.reshape(-1, 16).mean(0)
    x = x.abs() + 0.1  # positive inputs: the chosen rows win for every token
    _, experts = softmax_topk(block.router(x.reshape(-1, 16)), 2, True)
    assert (experts[:, 0] == 4).all() and set(experts.flatten().tolist()) == {1, 4}
    torch.testing.assert_close(block(x), _per_token_reference(block, x), rtol=0, atol=1e-5)
    # and top-1 (every token to one expert, nothing for the other five)
    single = _block(top_k=1)
    single.router.weight.zero_()
    single.router.weight[2] = 1.0
    torch.testing.assert_close(single(x), single.experts[2](x), rtol=0, atol=1e-6)


def test_moe_gradients_reach_the_router_and_only_the_experts_used():
    block = _block()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    block(x).square().sum().backward()
    _, experts = softmax_topk(block.router(x), 2, True)
    used = set(experts.flatten().tolist())
    assert block.router.weight.grad.abs().sum() > 0
    for e, expert in enumerate(block.experts):
        assert (expert.w1.weight.grad is not None and expert.w1.weight.grad.abs().sum() > 0) == (e in used)


def test_bad_expert_configs_are_one_line_errors(saved, tmp_path):
    import json

    config = json.loads((saved["qwen3_moe"][1] / "config.json").read_text())
    for change, message in (({"num_experts_per_tok": 40}, "top_k must be in"),
                            ({"mlp_only_layers": "1"}, "mlp_only_layers must list"),
                            ({"num_experts": "8"}, "is not an integer")):
        bad = tmp_path / f"bad{len(message)}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        proc = hardy_main("info", "--model", str(bad))
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# --- GGUF: llama.cpp's qwen3moe / qwen2moe / Mixtral-style llama ---------------------------------------

ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
GGUF_CHANGES = {"qwen3_moe": dict(mlp_only_layers=[])}  # llama.cpp runs experts in every layer


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"{family}-gguf")
        build_hf_model(transformers, family, changes=GGUF_CHANGES.get(family)).save_pretrained(root / "hf")
        ours = load_model(str(root / "hf"))
        export_gguf(ours.model, ours.config, byte_level_tokenizer(), root / "m.gguf", "F32")
        out[family] = (ours, root / "m.gguf")
    return out


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_llama_cpp_gives_hardys_greedy_tokens_and_logits(ggufs, family):
    llama_cpp = pytest.importorskip("llama_cpp")
    source, path = ggufs[family]
    ours = load_model(str(path))
    assert (ours.config.family, ours.config.moe) == (source.config.family, source.config.moe)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, type_k=0, type_v=0, logits_all=True,
                          verbose=False)
    assert llm.metadata["general.architecture"] == ARCH[family]
    prompt = list(range(5, 15))
    theirs = llama_cpp_greedy(llm, prompt, GREEDY)
    assert generate(ours.model, prompt, SamplingConfig(max_new_tokens=GREEDY)).tokens == theirs
    tokens = torch.randint(4, 320, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    llm.reset()
    llm.eval(tokens)
    cpp = torch.from_numpy(np.asarray(llm.scores[:32], dtype=np.float32))
    mine = ours.model(torch.tensor([tokens]))[0]
    assert (cpp - mine).abs().max() < 2e-3 * mine.abs().max()
    torch.testing.assert_close(mine, source.model(torch.tensor([tokens]))[0], rtol=0, atol=1e-5)


@torch.inference_mode()
def test_quantized_gguf_experts_load_at_file_size_and_match_dequantized(ggufs, tmp_path):
    """Q8_0 experts are read natively (split from the stacked tensor, never dequantized): each holds the
    file's values exactly, and an MoE block computes with them what the dequantized block computes on
    the same input, to the int8 kernel's rounding. The router stays float (llama-quantize's rule too)."""
    source, _ = ggufs["qwen3_moe"]
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "q8.gguf", "Q8_0")
    native = load_model(str(tmp_path / "q8.gguf"), gguf="native")
    floated = load_model(str(tmp_path / "q8.gguf"), gguf="float")
    for li, (ours, ref) in enumerate(zip(native.model.layers, floated.model.layers)):
        block, reference = ours.feed_forward, ref.feed_forward
        assert isinstance(block.router, torch.nn.Linear)
        torch.testing.assert_close(block.router.weight, source.model.layers[li].feed_forward.router.weight)
        for e in (0, len(block.experts) - 1):
            for w in ("w1", "w3", "w2"):
                q = getattr(block.experts[e], w)
                assert q.quant_tensor().spec.bits == 8
                assert torch.equal(q.quant_tensor().dequantize(), getattr(reference.experts[e], w).weight)
        x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(li))
        torch.testing.assert_close(block(x), reference(x), rtol=0, atol=2e-2 * reference(x).abs().max().item())


def test_gguf_whose_expert_count_disagrees_with_its_tensors_is_a_one_line_error(ggufs, tmp_path):
    from test_gguf_families import _rewrite

    _, path = ggufs["qwen3_moe"]
    _rewrite(path, tmp_path / "bad.gguf", {"qwen3moe.expert_count": 5})
    proc = hardy_main("generate", "--model", str(tmp_path / "bad.gguf"), "--prompt", "x", "--max-new-tokens", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "blk.0.ffn_gate_exps.weight" in proc.stderr and "5 experts" in proc.stderr, proc.stderr


# --- compression: every expert is calibrated, also those the text rarely routes to ---------------------

@torch.inference_mode()
def test_gptq_calibrates_every_expert_even_those_no_token_reaches(saved):
    """A router that sends every calibration token to the same three experts (all scores tie: the lowest
    indices win): the other nine are still quantized from real statistics (every token of their
    layer), so GPTQ beats RTN on them too."""
    from hardy.compress.pipeline import CompressConfig, compress_model
    from hardy.formats.quantized import QuantSpec, rtn

    ours = load_model(str(saved["qwen3_moe"][1]))
    model = ours.model
    block = model.layers[0].feed_forward
    block.router.weight.zero_()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    calib = torch.randint(0, 320, (8, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the layer-0 MoE input, to measure each expert's output error on
        h = model.embed(calib)
        rope = model.rotary(0, 64, torch.float32)
        layer = model.layers[0]
        h = h + layer.attention(layer.attention_norm(h), *rope.of(layer.kind))
        moe_in = layer.ffn_norm(h).reshape(-1, 64)
    _, experts = softmax_topk(block.router(moe_in), 3, True)
    assert set(experts.flatten().tolist()) == {0, 1, 2}
    result = compress_model(model, CompressConfig(quant="gptq", bits=4, group_size=32), calib, progress=False)
    names = {r.name for r in result.reports}
    for e in range(12):  # every projection of every expert in every MoE layer, never the router
        for w in ("w1", "w3", "w2"):
            assert f"layers.0.feed_forward.experts.{e}.{w}.weight" in names
    assert not any("router" in n for n in result.quantized)
    spec = QuantSpec(4, 32)
    for e in (3, 7, 11):  # experts the calibration text never reached
        name = f"layers.0.feed_forward.experts.{e}.w1.weight"
        w = original[name]
        gptq_err = (moe_in @ (result.quantized[name].dequantize() - w).t()).norm()
        rtn_err = (moe_in @ (rtn(w, spec).dequantize() - w).t()).norm()
        assert gptq_err < 0.9 * rtn_err, (e, float(gptq_err), float(rtn_err))


def test_compressed_moe_model_generates_through_the_cli(saved, tmp_path):
    hf_dir = tmp_path / "hf"
    import shutil

    shutil.copytree(saved["qwen2_moe"][1], hf_dir)
    byte_level_tokenizer().save_hf(hf_dir)
    out = tmp_path / "int4"
    proc = hardy_main("compress", "--model", str(hf_dir), "--out", str(out), "--quant", "awq", "--bits", "4",
                      "--group-size", "32", "--calib-data", "tinyshakespeare", "--calib-samples", "4",
                      "--calib-seq", "32", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    loaded = load_model(str(out))
    assert loaded.model.layers[1].feed_forward.experts[5].w2.quant_tensor().spec.bits == 4
    proc = hardy_main("generate", "--model", str(out), "--prompt", "hello", "--max-new-tokens", "6")
    assert proc.returncode == 0 and proc.stdout.startswith("hello"), proc.stderr


# --- the grouped expert kernel (csrc/moe.cpp) ----------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@torch.inference_mode()
def test_grouped_expert_kernel_equals_the_per_expert_loop(ggufs, tmp_path, qtype):
    """One C++ call for all experts against the block's own loop over its active experts (each expert's
    quantized kernels in turn): decode (one token), a small batch, every token to one expert, and
    batched rows that share experts."""
    from hardy.compress import kernels

    assert kernels.load() is not None, "the kernels are built by make test"
    source, _ = ggufs["qwen3_moe"]
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "q.gguf", qtype)
    model = load_model(str(tmp_path / "q.gguf"), gguf="native").model
    block = model.layers[1].feed_forward
    assert block.grouped is not None
    gen = torch.Generator().manual_seed(9)
    for shape in ((1, 1, 64), (1, 7, 64), (4, 1, 64), (2, 12, 64)):
        x = torch.randn(*shape, generator=gen)
        grouped = block(x)
        saved, block.grouped = block.grouped, None
        loop = block(x)
        block.grouped = saved
        torch.testing.assert_close(grouped, loop, rtol=0, atol=1e-5 * loop.abs().max().item())
    block.router.weight.zero_()  # ties: every token to experts 0, 1, 2; the other nine get nothing
    x = torch.randn(3, 9, 64, generator=gen)
    grouped = block(x)
    block.grouped = None
    torch.testing.assert_close(grouped, block(x), rtol=0, atol=1e-5 * grouped.abs().max().item())


def test_grouped_expert_kernel_refuses_bad_routes(ggufs, tmp_path):
    source, _ = ggufs["qwen3_moe"]
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "q.gguf", "Q8_0")
    block = load_model(str(tmp_path / "q.gguf"), gguf="native").model.layers[0].feed_forward
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside"):
        block.grouped(x, torch.ones(2, 3), torch.tensor([[0, 1, 12], [0, 1, 2]]))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_decode_stack_computes_moe_blocks_as_the_modules_do(ggufs, tmp_path, family):
    """Decode through the C++ block stack (router, top-k, grouped experts inside it; Qwen2-MoE's shared
    expert and its sigmoid gate too, and without the gate as Llama 4 has it) against the modules
    (each block's attention and MoE block in PyTorch, the experts' own kernels): batched rows at their
    own positions, and the same greedy tokens. An fp32 cache: the two paths' keys differ in the last
    fp32 bit, which a bf16 cache can round one bf16 step apart, and a route may follow it."""
    from hardy.infer.fused_decode import fused_blocks, use_fused_blocks
    from test_kernels import _batched_decode

    source, _ = ggufs[family]
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "q.gguf", "Q4_0")
    model = load_model(str(tmp_path / "q.gguf"), gguf="native").model
    assert fused_blocks(model) is not None
    prompts = torch.randint(0, 320, (3, 30), generator=torch.Generator().manual_seed(1))
    lengths = [30, 11, 23]
    fused = _batched_decode(model, prompts, lengths, True, torch.float32)
    modules = _batched_decode(model, prompts, lengths, False, torch.float32)
    assert (fused - modules).norm() / modules.norm() < 1e-5
    if family == "qwen2_moe":  # the shared expert added unscaled: a different sum, still the modules'
        for block in model.layers:
            block.feed_forward.shared_gate = None
        use_fused_blocks(model)  # built again for the changed blocks
        assert fused_blocks(model) is not None
        ungated = _batched_decode(model, prompts, lengths, True, torch.float32)
        assert (ungated - _batched_decode(model, prompts, lengths, False, torch.float32)).norm() / ungated.norm() < 1e-5
        assert (ungated - fused).norm() / fused.norm() > 1e-3
    prompt = list(range(5, 20))
    with torch.inference_mode():
        fast = generate(model, prompt, SamplingConfig(max_new_tokens=GREEDY), kv_dtype=torch.float32).tokens
        use_fused_blocks(model, False)  # the modules from here on
        assert generate(model, prompt, SamplingConfig(max_new_tokens=GREEDY), kv_dtype=torch.float32).tokens == fast


# --- the planner: total vs active parameters, experts shared across a batch ----------------------------

def test_plan_serve_reads_only_the_routed_experts_and_shares_them_across_a_batch(ggufs, tmp_path):
    from hardy.plan.hardware import get_hardware
    from hardy.plan.serve import distinct_experts, plan_serve
    from hardy.plan.weights import layout_from_gguf

    assert distinct_experts(128, 8, 1) == pytest.approx(8)
    assert distinct_experts(128, 8, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert 127 < distinct_experts(128, 8, 512) <= 128
    # a Qwen3-30B-A3B-shaped config: 30.5B parameters, 3.3B of them active per token
    cfg = ModelConfig(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, head_dim=128,
                      max_seq_len=40960, family="qwen3_moe", qk_norm=True,
                      moe=MoEConfig(n_experts=128, top_k=8, ffn_dim=768, norm_topk_prob=True))
    from hardy.model.config import count_parameters

    counts = count_parameters(cfg)
    assert 30.0e9 < counts.total < 31.0e9 and 3.2e9 < counts.active < 3.5e9
    hw = get_hardware("epyc-genoa")
    one, eight = (plan_serve(cfg, hw, quant="int4", context=4096, output_tokens=256, batch=b) for b in (1, 8))
    dense_bytes = counts.total * 0.625  # every weight at int4 g32 (4 bits + fp16 scale and min per 32)
    assert one.weight_bytes == pytest.approx(dense_bytes, rel=0.02)
    # batch 1 reads the attention, routers, head and 8 experts per layer: about the active parameters
    assert one.step_bytes_per_device < 0.2 * dense_bytes
    expert_layer = 3 * 2048 * 768 * 0.625
    kv = one.kv_bytes_per_token * (4096 - 256 + 128) + 0.625 * 2048  # per sequence: its KV and an embedding row
    shared = eight.step_bytes_per_device - 8 * kv - (one.step_bytes_per_device - kv)
    assert shared == pytest.approx(48 * (distinct_experts(128, 8, 8) - 8) * expert_layer, rel=1e-6)
    assert any("3.3" in n and "active" in n for n in one.notes)
    # the active experts stream at the grouped kernel's measured rate, the rest at the dense kernel's
    import dataclasses

    cpu = dataclasses.replace(hw, quantized_decode_bandwidth=40e9, expert_decode_bandwidth=20e9)
    split = plan_serve(cfg, cpu, quant="int4", context=4096, output_tokens=256, batch=1)
    routed = 48 * 8 * expert_layer
    assert split.step_memory_s == pytest.approx((split.step_bytes_per_device - routed) / 40e9 + routed / 20e9)
    # a GGUF file's stacked experts are counted as experts, at the file's own bytes
    source, _ = ggufs["qwen3_moe"]
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "q8.gguf", "Q8_0")
    layout = layout_from_gguf(tmp_path / "q8.gguf")
    m = source.config.moe
    per_expert = 3 * 64 * m.ffn_dim * (1 + 2 / 32)  # Q8_0: a byte and a share of an fp16 scale per weight
    assert layout.expert_bytes == pytest.approx(source.config.n_layers * m.n_experts * per_expert)
