"""llama.cpp's own tools as the baseline (llama-bench, llama-perplexity, llama-server), built from source by
bench/llama_cpp_build.sh, and the statistics every comparison reports: medians with a 95% interval over
alternating repetitions, the CPU and the llama.cpp commit."""
from __future__ import annotations

import http.client
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_CPP = "llama-cpp-python 0.3.36 sdist, llama.cpp commit 0c1e57098bba, -DGGML_NATIVE=ON"


# Set once this llama.cpp's AMX build has died (SIGILL or SIGSEGV) on this machine: from then on every run
# uses the build with AMX masked (bench/llama_cpp_build.sh, LLAMA_CPP_AMX=off), and llama_cpp_label says so.
_amx_crashed = False


def llama_bin(amx: bool = True) -> Path:
    """The directory of the native tools (built on first use: ~10-15 minutes on 2 cores); `amx` False:
    the copy built with the AMX instructions masked."""
    env = {**__import__("os").environ, "PYTHON": sys.executable, "LLAMA_CPP_AMX": "on" if amx else "off"}
    out = subprocess.run(["bash", str(HERE / "llama_cpp_build.sh")], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"building llama.cpp failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def llama_cpp_label() -> str:
    return LLAMA_CPP + (", AMX masked (its AMX build crashed here)" if _amx_crashed else "")


def amx_build_crashed(tool: str, returncode: int | None) -> bool:
    """Whether `tool`'s exit was the AMX build's crash; the first one switches every later llama.cpp run to the
    build with AMX masked (llama_bin(not _amx_crashed)) and says so. This version's AMX build dies on the Xeons
    we run on: SIGILL (tileloadd on a worker thread) on most files, SIGSEGV on a Q4_K_M one and in llama-server;
    the build with AMX masked runs the same files."""
    global _amx_crashed
    if _amx_crashed or returncode not in (-signal.SIGILL, -signal.SIGSEGV):
        return False
    _amx_crashed = True
    print(f"{tool} died with {signal.Signals(-returncode).name} in the AMX build; every llama.cpp run from here on "
          "uses the build with AMX masked", file=sys.stderr, flush=True)
    return True


def wait_healthy(port: int, proc: subprocess.Popen, seconds: float) -> bool:
    """Poll a server's GET /health on 127.0.0.1:`port` until it answers 200 (True), or until `proc` exits or
    `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def llama_bench(model: Path, threads: int, prompt: int = 0, gen: int = 128, reps: int = 1,
                extra: tuple[str, ...] = ()) -> list[float]:
    """tokens/s samples of `llama-bench` (one test: pp`prompt` or tg`gen`)."""
    args = ["-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-o", "json", *extra]
    out = subprocess.run([str(llama_bin(not _amx_crashed) / "llama-bench"), *args], capture_output=True, text=True)
    if amx_build_crashed("llama-bench", out.returncode):
        out = subprocess.run([str(llama_bin(False) / "llama-bench"), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rows = json.loads(out.stdout)
    return [float(x) for row in rows for x in row["samples_ts"]]


def llama_perplexity(model: Path, text: Path, ctx: int, threads: int, chunks: int | None = None) -> tuple[float, float]:
    """(PPL, its standard error) from llama-perplexity's final estimate."""
    cmd = [str(llama_bin() / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "-t", str(threads),
           "-b", str(ctx)] + (["--chunks", str(chunks)] if chunks else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def median_ci(samples: list[float]) -> tuple[float, float, float]:
    """(median, low, high): a distribution-free 95% interval for the median from order statistics (the
    widest available, min..max, below 6 samples)."""
    xs = sorted(samples)
    n = len(xs)
    med = statistics.median(xs)
    if n < 6:
        return med, xs[0], xs[-1]
    # the largest k with P(Binomial(n, 1/2) < k) <= 2.5%: [x_k, x_(n-k+1)] covers the median with >= 95%
    k, total = 0, 0.0
    while True:
        total += math.comb(n, k) / 2 ** n
        if total > 0.025:
            break
        k += 1
    return med, xs[max(0, k - 1)], xs[min(n - 1, n - k)]


def cpu_line() -> str:
    """The CPU model and the vector extensions the kernels dispatch on."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split()) if "flags" in info else set()
    wanted = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name.group(1).strip() if name else 'unknown CPU'} ({', '.join(wanted)})"


def fmt(med: float, lo: float, hi: float, digits: int = 1) -> str:
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
