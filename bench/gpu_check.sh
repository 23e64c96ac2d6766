#!/usr/bin/env bash
# The one prepared check for a GPU machine (issue 19; docs/gpu.md), within a time budget (default 460 s):
#   1. install hardy into the machine's own Python (no network: carried wheels from bench/gpu_stage.sh)
#   2. the `cuda` test tier (tests/test_cuda.py)
#   3. training throughput of 8 of Llama 3.1 8B's layers, bf16, FSDP2 at world size 1, compile on/off,
#      activation checkpointing off/on, beside `hardy plan train` (bench/gpu_train_throughput.py)
#   4. SmolLM2-135M decode tokens/s on CUDA, eager and CUDA-graph compiled, greedy tokens vs the CPU's
#   and between them `hardy probe` of the GPU, so the planner is also checked with the rates measured there,
#   one NVML telemetry sample (hardy.ops.telemetry, real sensors) and `hardy doctor`'s table
# Everything lands in $OUT (gpu_check.json: one summary; the logs and per-part JSON beside it). Parts are
# run in order of importance; one that the budget no longer allows is recorded as not run, with why.
#
#   bash bench/gpu_check.sh              on a GPU machine (after `--stage`, see bench/gpu_stage.sh)
#   bash bench/gpu_check.sh --stage      first call: keep the carried first half of the SmolLM2 wheel
#   bash bench/gpu_check.sh --dry-run    here, on the CPU: the same steps at toy sizes (a rehearsal)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
STAGE=/tmp/hardy-gpu-stage
MODE=${1:-gpu}
if [ "$MODE" = "--stage" ]; then  # the first call: the machine stays warm, /tmp stays with it
  mkdir -p "$STAGE" && cp -v .gpu/part1/* "$STAGE"/ && exit 0
  exit 1
fi
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-460}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
say() { echo "[gpu_check $(elapsed)s] $*"; }
STATUS="$OUT/status.txt"
: > "$STATUS"
note() { echo "$1: $2" >> "$STATUS"; say "$1: $2"; }

if [ "$MODE" = "--dry-run" ]; then
  PY=${PYTHON:-$REPO/.venv/bin/python}
  DEVICE=cpu
else
  PY=${PYTHON:-python3}
  DEVICE=cuda
fi
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- 1. install
SITE=/tmp/hardy-site
mkdir -p "$SITE"
if [ "$DEVICE" = cuda ]; then
  if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/wheels/*.whl
  fi
  if [ -f .gpu/part2/SHA256SUMS ]; then  # SmolLM2's wheel: first half staged by --stage, second carried now
    wheel="/tmp/$(awk '{print $2}' .gpu/part2/SHA256SUMS)"
    cat "$STAGE/$(basename "$wheel").part0" ".gpu/part2/$(basename "$wheel").part1" > "$wheel" 2>/dev/null
    if (cd /tmp && sha256sum -c "$REPO/.gpu/part2/SHA256SUMS" >/dev/null 2>&1); then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" && note smollm2 "installed"
    else
      note smollm2 "the two halves did not reassemble (was --stage run on this machine just before?)"
    fi
  fi
  export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import hardy" || { note install "hardy does not import with $PY"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1
fi
"$PY" - > "$OUT/env.json" <<'EOF'
import json, platform, torch
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
EOF
HAVE_SMOLLM2=$("$PY" -c "from hardy.formats.packaged import smollm2_gguf_path; smollm2_gguf_path(); print(1)" 2>/dev/null || echo 0)
say "installed: $(cat "$OUT/env.json"); SmolLM2 weights: $([ "$HAVE_SMOLLM2" = 1 ] && echo yes || echo no)"
"$PY" -m hardy.compress.kernels > "$OUT/kernels.log" 2>&1 || note kernels "the CPU kernels did not build (see kernels.log)"

# ---------------------------------------------------------------- 2. the cuda tier
run_part() {  # name, seconds wanted (at most), command...
  local name=$1 want=$2; shift 2
  local budget=$(( $(left) < want ? $(left) : want ))
  if [ "$budget" -lt 30 ]; then note "$name" "not run: $(left) s of the budget left"; return 1; fi
  say "$name (up to ${budget}s)"
  timeout "$budget" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 124 ]; then note "$name" "cut off after ${budget}s"; elif [ $rc -ne 0 ]; then note "$name" "exit $rc"; else note "$name" ok; fi
  tail -3 "$OUT/$name.log"
  return $rc
}
TESTS=(tests/test_cuda.py)
[ "$HAVE_SMOLLM2" = 1 ] || TESTS+=(-k "not smollm2 and not generate_and_perplexity and not serving_engine")
run_part cuda_tier 200 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/cuda_tier.xml" "${TESTS[@]}"

# ---------------------------------------------------------------- the device measured for the planner
# matmul, a real layer's GEMMs and attention by size, elementwise and copy bandwidth, launch cost:
# `hardy plan train --hardware probe:FILE` uses them in place of the catalogue's datasheet figures
run_part probe 90 "$PY" -m hardy probe --quick --out "$OUT/probe.json" --dir /tmp
PROBE=()
[ -f "$OUT/probe.json" ] && PROBE=(--probe "$OUT/probe.json")

# ---------------------------------------------------------------- health: NVML telemetry and the doctor
# one telemetry sample of the GPU (real NVML, where the tests use a stand-in) and the pre-flight table
run_part telemetry 30 "$PY" -c "
import json, sys
from hardy.ops.telemetry import open_gpu_sensors, take_sample
gpu = open_gpu_sensors(0 if '$DEVICE' == 'cuda' else None)
json.dump(take_sample('/tmp', gpu), open('$OUT/telemetry.json', 'w'), indent=1)
sys.exit(0 if gpu is not None or '$DEVICE' != 'cuda' else 1)"
run_part doctor 60 "$PY" -m hardy doctor --run-dir /tmp/hardy-doctor --json "$OUT/doctor.json"

# ---------------------------------------------------------------- 3. training throughput, 4. decode
if [ "$DEVICE" = cuda ]; then
  TRAIN=(--preset llama3.1-8b --layers 8 --seq 8192 --steps 7 --warmup 3 --device cuda --precision bf16
         --hardware h200 --peak-tflops 989)
  DECODE=(--model smollm2-135m --device cuda --new-tokens 128)
else  # the rehearsal: the same scripts and parsing, at a size a CPU runs in seconds
  TRAIN=(--preset tiny --layers 2 --seq 128 --steps 4 --warmup 2 --device cpu --precision fp32
         --hardware epyc-genoa --peak-tflops 0.1 --timeout 240)
  DECODE=(--model smollm2-135m --device cpu --new-tokens 8 --check-tokens 8 --repeats 1)
fi
train() {  # part name, configs
  run_part "$1" 240 "$PY" bench/gpu_train_throughput.py --out "$OUT/$1.json" "${TRAIN[@]}" "${PROBE[@]}" --configs "$2"
}
train train_compiled "ac=none,compile=true"
if [ "$HAVE_SMOLLM2" = 1 ]; then
  run_part decode 90 "$PY" bench/gpu_decode.py --out "$OUT/decode.json" "${DECODE[@]}"
else
  note decode "not run: no SmolLM2 weights on this machine (bench/gpu_stage.sh, then --stage)"
fi
train train_eager "ac=none,compile=false"
train train_ac "ac=full,compile=false;ac=full,compile=true"

# ---------------------------------------------------------------- summary
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {"status": dict(l.split(": ", 1) for l in (out / "status.txt").read_text().splitlines() if ": " in l)}
for name in ("env", "probe", "telemetry", "doctor", "train_compiled", "train_eager", "train_ac", "decode"):
    f = out / f"{name}.json"
    if f.is_file():
        summary[name] = json.loads(f.read_text())
        for run in (summary[name].get("runs", []) if isinstance(summary[name], dict) else []):
            run.pop("losses", None)
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary["status"], indent=1))
EOF
say "done; results in $OUT/gpu_check.json"
grep -qv ": ok$\|^smollm2: installed$" "$STATUS" && exit 1
exit 0
