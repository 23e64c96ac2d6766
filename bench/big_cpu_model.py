"""Real-size CPU inference without downloading weights: a Llama-3.1-8B-shaped (or 13B-class) model
with random weights is written straight to GGUF, tensor by tensor (never the whole model in memory),
then run by hardy (native quantized load) and llama.cpp (llama-cpp-python) on the same file, in
alternating subprocesses: load time, time to first token for a 512-token prompt, decode tokens/s at
batch 1 and at batch `--batch` (8 sequences of a 64-token prompt decoding together, as a server runs
them: hardy's serving step — fused blocks + LM head — and llama.cpp's llama_decode on one 8-sequence
batch), peak RSS, and decode's share of this machine's measured DRAM read bandwidth.

    .venv/bin/python bench/big_cpu_model.py --shape llama3.1-8b --type Q4_0 --dir /tmp/big --threads 2

Shapes use SmolLM2's BPE vocabulary (llama.cpp needs a real tokenizer in the file); the 8B shape pads
it with reserved control tokens to Llama 3's 128,256 entries, the 13B-class shape keeps its 49,152.
`--type Q4_K_M` writes Q4_K matrices with Q6_K for the output and for attn_v / ffn_down in the layers
llama.cpp's Q4_K_M gives more bits (the first and last eighth, and every third in between); `--type
Q5_K_M` the same with Q5_K matrices.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256,
                              rope_theta=500000.0),
          "13b-class": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab=49152,
                            rope_theta=10000.0),
          "8b-3layers": dict(dim=4096, n_layers=3, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256,
                             rope_theta=500000.0),  # the 8B shape's widths, for quick memory checks
          "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab=49152, rope_theta=10000.0),
          # Llama 3.2 1B's widths, a tied head and the 131,072-position context real Llama 3.x files declare
          "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab=128256,
                              rope_theta=500000.0, tied=True, context=131072)}


def tensor_plan(shape: dict, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, PyTorch-order shape, type) in llama.cpp's order."""
    d, f, v, n = shape["dim"], shape["ffn_dim"], shape["vocab"], shape["n_layers"]
    kv = d // shape["n_heads"] * shape["n_kv_heads"]
    k_mix = qtype in ("Q4_K_M", "Q5_K_M")
    base = qtype[:4] if k_mix else qtype

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits for Q4_K_M and Q5_K_M
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    plan = [("token_embd.weight", (v, d), base)]
    for i in range(n):
        hi = "Q6_K" if k_mix and more_bits(i) else base
        plan += [(f"blk.{i}.attn_norm.weight", (d,), "F32"), (f"blk.{i}.attn_q.weight", (d, d), base),
                 (f"blk.{i}.attn_k.weight", (kv, d), base), (f"blk.{i}.attn_v.weight", (kv, d), hi),
                 (f"blk.{i}.attn_output.weight", (d, d), base), (f"blk.{i}.ffn_norm.weight", (d,), "F32"),
                 (f"blk.{i}.ffn_gate.weight", (f, d), base), (f"blk.{i}.ffn_up.weight", (f, d), base),
                 (f"blk.{i}.ffn_down.weight", (d, f), hi)]
    plan += [("output_norm.weight", (d,), "F32")]
    if not shape.get("tied"):
        plan += [("output.weight", (v, d), "Q6_K" if k_mix else base)]
    return plan


# fp16 scale fields of each block type (byte offsets) and a scale that keeps random weights ~N(0, 0.02)
SCALES = {"Q4_0": ((0,), 0.005), "Q8_0": ((0,), 0.0003), "Q4_K": ((0, 2), 0.0003), "Q5_K": ((0, 2), 0.00015),
          "Q6_K": ((208,), 0.0003)}


def random_blocks(rng, rows: int, cols: int, qtype: str) -> np.ndarray:
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    offsets, scale = SCALES[qtype]
    d = np.full(blocks.shape[:2], scale, dtype=np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    for o in offsets:
        blocks[:, :, o:o + 2] = d
    if qtype == "Q6_K":  # int8 sub-block scales around 16
        blocks[:, :, 192:208] = rng.integers(8, 24, (rows, cols // values, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, shape_name: str, qtype: str, seed: int = 0) -> None:
    import gguf

    shape = SHAPES[shape_name]
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"{shape_name}-random-{qtype}")
    w.add_context_length(shape.get("context", 8192))
    w.add_embedding_length(shape["dim"])
    w.add_block_count(shape["n_layers"])
    w.add_feed_forward_length(shape["ffn_dim"])
    w.add_head_count(shape["n_heads"])
    w.add_head_count_kv(shape["n_kv_heads"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(shape["dim"] // shape["n_heads"])
    add_vocabulary(w, shape["vocab"])
    write_random_tensors(w, tensor_plan(shape, qtype), seed)
    os.replace(tmp, path)


def add_vocabulary(w, vocab: int) -> None:
    """SmolLM2's BPE vocabulary (llama.cpp needs a real tokenizer in the file), padded to `vocab` entries
    with control tokens, which the BPE merges never produce."""
    from hardy.formats.gguf_io import open_gguf
    from hardy.formats.packaged import smollm2_gguf_path

    fields = open_gguf(smollm2_gguf_path()).fields
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    pad = vocab - len(tokens)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields.get("tokenizer.ggml.pre", "gpt-2"))
    w.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(pad)])
    w.add_token_types(types + [3] * pad)
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))


def write_random_tensors(w, plan: list[tuple[str, tuple[int, ...], str]], seed: int) -> None:
    """The tensor infos, then each tensor's data one at a time (never the model in memory): "F32" ones
    (norms), "F32R" random normal * 0.05 (routers: tokens spread over the experts), else random blocks
    of that GGUF type along the last dimension; closes the writer."""
    import gguf

    for name, dims, t in plan:
        if t.startswith("F32"):
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            qt = gguf.GGMLQuantizationType[t]
            values, size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = (*dims[:-1], dims[-1] // values * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, t in plan:
        if t == "F32":
            data = np.ones(dims, np.float32)
        elif t == "F32R":
            data = rng.standard_normal(dims, dtype=np.float32) * 0.05
        else:
            data = random_blocks(rng, int(np.prod(dims[:-1])), dims[-1], t).reshape(*dims[:-1], -1)
        w.write_tensor_data(data)
    w.close()


def read_bandwidth(threads: int) -> float:
    """Bytes/s a 2-GiB fp32 sum reads at (best of 5): what decode, which streams the weights, can reach."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2 ** 29, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def vm_hwm() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


BATCH_PROMPT = 64  # tokens per sequence before the batched decode


def hardy_batch_decode(model, batch: int, steps: int) -> float:
    """Aggregate tokens/s of `steps` decode steps over `batch` sequences through `hardy serve`'s own
    runner (paged bf16 KV cache, the fused blocks, the LM head)."""
    import torch

    from hardy.infer.kv import BLOCK
    from hardy.serve.engine import ModelRunner

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(1000, 40000, (batch, BATCH_PROMPT), generator=gen)
    tokens = torch.randint(1000, 40000, (steps, batch, 1), generator=gen)
    context = BATCH_PROMPT + steps + 8
    runner = ModelRunner(model, batch, context, capacity=batch * -(-context // BLOCK) * BLOCK)
    rows = list(range(batch))
    try:
        for row in rows:
            runner.prefill(row, prompts[row:row + 1])
        positions = torch.full((batch,), BATCH_PROMPT, dtype=torch.long)
        runner.decode(tokens[0], positions, rows)  # warm-up step
        t0 = time.perf_counter()
        for step in range(1, steps):
            runner.decode(tokens[step], positions + step, rows)
        return batch * (steps - 1) / (time.perf_counter() - t0)
    finally:
        model.clear_kv_cache()


def llama_batch_decode(path: Path, threads: int, batch: int, steps: int) -> float:
    """The same through llama.cpp's C API: one llama_decode per step over `batch` sequences."""
    import llama_cpp as lc

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = batch * (BATCH_PROMPT + steps + 8)
    cparams.n_batch = cparams.n_ubatch = batch * BATCH_PROMPT
    cparams.n_seq_max = batch
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    b = lc.llama_batch_init(batch * BATCH_PROMPT, 0, batch)
    rng = np.random.default_rng(2)

    def submit(rows: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if lc.llama_decode(ctx, b):
            raise SystemExit("llama_decode failed")

    submit([(int(rng.integers(1000, 40000)), p, s, p == BATCH_PROMPT - 1)
            for s in range(batch) for p in range(BATCH_PROMPT)])
    submit([(int(rng.integers(1000, 40000)), BATCH_PROMPT, s, True) for s in range(batch)])  # warm-up step
    t0 = time.perf_counter()
    for step in range(1, steps):
        submit([(int(rng.integers(1000, 40000)), BATCH_PROMPT + step, s, True) for s in range(batch)])
    tps = batch * (steps - 1) / (time.perf_counter() - t0)
    lc.llama_batch_free(b)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return tps


def worker(engine: str, path: Path, threads: int, prompt_len: int, new_tokens: int, batch: int) -> dict:
    rng = np.random.default_rng(1)
    prompt = rng.integers(1000, 40000, prompt_len).tolist()
    if engine == "hardy":
        from hardy.loading.load import load_model, set_threads
        from hardy.infer.generate import SamplingConfig, generate

        set_threads(threads)
        t0 = time.perf_counter()
        m = load_model(str(path), gguf="native")
        load_s = time.perf_counter() - t0
        from hardy.cli.common import use_fast_prefill

        use_fast_prefill(m)  # what hardy generate / serve do
        g = generate(m.model, prompt, SamplingConfig(max_new_tokens=new_tokens))
        ttft, decode_tps = g.stats.prefill_s, g.stats.decode_tps
        peak = vm_hwm()  # serving one request: before the batched run adds its caches
        batch_tps = hardy_batch_decode(m.model, batch, new_tokens // 2) if batch > 1 else float("nan")
        # the same serving step with one sequence: what batching multiplies
        step1_tps = hardy_batch_decode(m.model, 1, new_tokens // 2) if batch > 1 else float("nan")
    else:
        import llama_cpp

        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                              n_ctx=prompt_len + new_tokens + 8, n_batch=prompt_len, verbose=False)
        load_s = time.perf_counter() - t0
        eos = llm.token_eos()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, logit_bias={eos: -1e9})
        perf = llama_cpp.llama_perf_context(llm.ctx)  # llama.cpp's own timers (no Python in them)
        ttft = perf.t_p_eval_ms / 1e3
        decode_tps = perf.n_eval / (perf.t_eval_ms / 1e3)
        peak = vm_hwm()
        llm.close()  # the batched run maps (and llama.cpp repacks) the weights again
        del llm
        batch_tps = llama_batch_decode(path, threads, batch, new_tokens // 2) if batch > 1 else float("nan")
        step1_tps = float("nan")
    return {"engine": engine, "load_s": load_s, "ttft_s": ttft, "decode_tps": decode_tps, "batch_tps": batch_tps,
            "batch1_step_tps": step1_tps, "peak_rss": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M"))
    ap.add_argument("--dir", default="/tmp/hardy-big")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="sequences in the batched-decode run (1: none)")
    ap.add_argument("--engines", default="hardy,llama")
    ap.add_argument("--model", default=None, help="an existing GGUF file instead of --shape/--type/--dir")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = Path(args.model) if args.model else Path(args.dir) / f"{args.shape}.{args.type}.gguf"
    if args.worker:
        print(json.dumps(worker(args.worker, path, args.threads, args.prompt, args.new_tokens, args.batch)))
        return
    if not path.exists():
        if args.model:
            raise SystemExit(f"no such file: {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_gguf(path, args.shape, args.type)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    size = path.stat().st_size
    bandwidth = read_bandwidth(args.threads)
    print(f"file {size / 1e9:.2f} GB; DRAM read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)")
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # alternating, each in a fresh process
        for engine in args.engines.split(","):
            cmd = [sys.executable, __file__, "--worker", engine, "--shape", args.shape, "--type", args.type,
                   "--dir", args.dir, "--threads", str(args.threads), "--prompt", str(args.prompt),
                   "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)] + \
                (["--model", str(path)] if args.model else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{engine} worker failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.setdefault(engine, []).append(r)
            print(f"  {engine:6} load {r['load_s']:6.1f} s  ttft({args.prompt}) {r['ttft_s']:6.1f} s  "
                  f"decode {r['decode_tps']:5.2f} tok/s  batch {args.batch} {r['batch_tps']:5.2f} tok/s  "
                  f"peak RSS {r['peak_rss'] / 1e9:5.2f} GB", flush=True)
    keys = ("load_s", "ttft_s", "decode_tps", "batch_tps", "peak_rss")
    med = {e: {k: statistics.median(r[k] for r in rs) for k in keys} for e, rs in runs.items()}
    print(f"\n{'engine':8} {'load s':>7} {'TTFT s':>7} {'decode tok/s':>12} {'of DRAM bw':>10} "
          f"{'batch ' + str(args.batch) + ' tok/s':>14} {'peak RSS':>9}")
    for e, m in med.items():
        print(f"{e:8} {m['load_s']:7.1f} {m['ttft_s']:7.1f} {m['decode_tps']:12.2f} "
              f"{m['decode_tps'] * size / bandwidth:9.0%} {m['batch_tps']:14.2f} {m['peak_rss'] / 1e9:7.2f} GB")
    if "hardy" in med and "llama" in med:
        h, l = med["hardy"], med["llama"]
        print(f"hardy / llama.cpp: decode {h['decode_tps'] / l['decode_tps']:.2f}x, batch {args.batch} "
              f"{h['batch_tps'] / l['batch_tps']:.2f}x, prefill "
              f"{l['ttft_s'] / h['ttft_s']:.2f}x, load time {h['load_s'] / l['load_s']:.2f}x, "
              f"peak RSS {h['peak_rss'] / l['peak_rss']:.2f}x (file {size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
