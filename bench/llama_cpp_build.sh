#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-bench, llama-perplexity, llama-server, llama-cli) from source, the
# honest baseline for hardy's speed and quality comparisons: the llama.cpp that llama-cpp-python 0.3.36
# vendors (its sdist, from PyPI), compiled with -DGGML_NATIVE=ON for this CPU. Cached outside the repository:
#   $HARDY_CACHE/llama.cpp-0.3.36/build/bin/   (HARDY_CACHE defaults to ~/.cache/hardy)
# Prints the bin directory. ~10-15 minutes on 2 cores the first time; seconds after.
#
# LLAMA_CPP_AMX=off builds a second copy (llama.cpp-0.3.36-noamx) with the AMX instructions masked
# (-mno-amx-*), so ggml's AVX-512 path runs: on the Xeon of 2026-12-05 this version's AMX matmul dies
# with SIGILL (tileloadd on a worker thread) on a mixture-of-experts prompt, as upstream reports for
# MoE GGUFs (llama.cpp issues 20824, 28756). bench/native.py falls back to it only after that crash.
set -euo pipefail
VERSION=0.3.36
SUFFIX=""
FLAGS=()
if [ "${LLAMA_CPP_AMX:-on}" = "off" ]; then
  SUFFIX="-noamx"
  FLAGS=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
         -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
ROOT="${HARDY_CACHE:-$HOME/.cache/hardy}/llama.cpp-$VERSION$SUFFIX"
BIN="$ROOT/build/bin"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-perplexity" ] && [ -x "$BIN/llama-server" ]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src/vendor/llama.cpp" ]; then
  PY="${PYTHON:-python3}"
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/dl" -q >&2
  rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
  tar -xzf "$ROOT"/dl/llama_cpp_python-$VERSION.tar.gz -C "$ROOT/src" --strip-components=1
fi
cmake -S "$ROOT/src/vendor/llama.cpp" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON "${FLAGS[@]}" >&2
cmake --build "$ROOT/build" -j"$(nproc)" --target llama-bench llama-perplexity llama-server llama-cli >&2
echo "$BIN"
