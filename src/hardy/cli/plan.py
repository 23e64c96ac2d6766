"""hardy plan: what a deployment (or run) needs and achieves on given hardware, before renting it.

A command group: one `register_*` and one `run_*` function per subcommand.
"""
from __future__ import annotations

import json

from hardy.cli import plan_goodput, plan_train
from hardy.cli.common import Parser
from hardy.errors import HardyError
from hardy.loading.load import config_for, is_quantized_source, resolve_source
from hardy.plan.hardware import get_hardware
from hardy.plan.rerank import QUERY_TOKENS, TEMPLATE_TOKENS, plan_rerank
from hardy.plan.serve import FILE, KV_DTYPES, QUANTS, plan_serve
from hardy.plan.weights import layout_from_gguf


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan memory, speed and cost on a hardware catalogue entry or probe profile")
    group = p.add_subparsers(dest="plan_command", required=True, parser_class=Parser)
    register_serve(group)

    plan_train.register(group)
    plan_goodput.register(group)


def _add_hardware_args(p) -> None:
    p.add_argument("--model", required=True, help="a preset (smollm2-135m, llama3.1-8b, ...), a .gguf file "
                                                  "or a model directory (only its config is read)")
    p.add_argument("--hardware", required=True, help="a catalogue entry (h100-sxm, l40s, xeon-spr, ...) or "
                                                     "probe:FILE (a profile written by `hardy probe`)")
    p.add_argument("--devices", type=int, default=1, help="GPUs or CPU sockets, tensor parallel (default 1)")
    p.add_argument("--catalogue", default=None, help="a hardware catalogue TOML instead of the built-in one")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def register_serve(group) -> None:
    p = group.add_parser("serve", help="serving: memory per device, largest batch, latency, tokens/s, cost")
    _add_hardware_args(p)
    p.add_argument("--quant", default=None, choices=(*QUANTS, FILE),
                   help="weight format; file: a quantized .gguf --model's own tensor types as hardy loads them "
                        "(default for such a file; fp16 otherwise)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES, help="KV cache dtype (default fp16; fp32 "
                                                                       "with --quant fp32)")
    p.add_argument("--context", type=int, default=2048, help="tokens of KV cache per sequence (default 2048)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default: context - output tokens")
    p.add_argument("--output-tokens", type=int, default=256)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--batch", type=int, default=None, help="concurrent sequences (default 1)")
    load.add_argument("--qps", type=float, default=None, help="requests/s to sustain: finds the batch")
    p.add_argument("--workload", default="generate", choices=("generate", "rerank"),
                   help="generate (default): prompts and output tokens; rerank: query-likelihood re-ranking "
                        "of --candidates passages per query (hardy eval rank, POST /v1/rerank)")
    p.add_argument("--candidates", type=int, default=20, help="rerank: candidates scored per query")
    p.add_argument("--passage-tokens", type=int, default=128, help="rerank: tokens per candidate passage")
    p.add_argument("--query-tokens", type=int, default=QUERY_TOKENS, help="rerank: tokens per query")
    p.add_argument("--template-tokens", type=int, default=TEMPLATE_TOKENS,
                   help="rerank: prompt tokens around each passage")
    p.add_argument("--rerank-batch", type=int, default=20, help="rerank: candidate rows per forward pass")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    hw = get_hardware(args.hardware, args.catalogue)
    quant, layout = args.quant, None
    if quant is None:
        quant = FILE if is_quantized_source(args.model, gguf="native") else "fp16"
    if quant == FILE:
        try:
            kind, path = resolve_source(args.model)
        except HardyError:  # a preset: a config without a file
            kind = None
        if kind != "gguf":
            raise HardyError(f"--quant file reads a .gguf file's tensor types; {args.model} is not a GGUF file")
        layout = layout_from_gguf(path)
    if args.workload == "rerank":
        plan = plan_rerank(config_for(args.model), hw, devices=args.devices, quant=quant, candidates=args.candidates,
                           passage_tokens=args.passage_tokens, query_tokens=args.query_tokens,
                           template_tokens=args.template_tokens, rerank_batch=args.rerank_batch, layout=layout)
        _print(plan, args.json)
        return 0
    plan = plan_serve(config_for(args.model), hw, devices=args.devices, quant=quant, context=args.context,
                      output_tokens=args.output_tokens, batch=args.batch, qps=args.qps,
                      prompt_tokens=args.prompt_tokens, kv_dtype=args.kv_dtype, layout=layout)
    _print(plan, args.json)
    return 0


def _print(plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.to_dict()))
        return
    rows = plan.rows()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
