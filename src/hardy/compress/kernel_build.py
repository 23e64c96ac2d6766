"""What the quantized decode kernels are built from and with, shared by the two builds: setup.py's, when
the package is built or installed (one module per instruction set, `hardy.compress._kernels_<isa>`),
and kernels.py's compile on first use, where the install built none that this process can use.

Standard library only at import: setup.py loads this file by path, before hardy or its dependencies
are installed.
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# several translation units so the cores compile in parallel and only bindings.cpp pays for pybind
SOURCES = [CSRC / name for name in ("qgemv.cpp", "gguf_tiled.cpp", "decode_layer.cpp", "moe.cpp", "bindings.cpp")]
HEADERS = [CSRC / name for name in ("qgemv.h", "tiles.h", "dequant_tiles.h", "kv.h", "attention.h")]

AVX2 = ["-mavx2", "-mfma", "-mf16c"]
VNNI = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]  # 256-bit dpbusd
# the narrowest first; generic is the portable scalar build (odd CPUs, and the parity tests' reference)
VARIANTS = {"generic": [], "avx2": AVX2, "avx512vnni": VNNI}


def module_name(isa: str) -> str:
    return f"hardy.compress._kernels_{isa}"


def variants_for(machine: str | None = None) -> list[str]:
    """The builds an install makes: every x86-64 variant (the package may move to another x86 CPU;
    the loader picks the widest this one runs), the portable one elsewhere."""
    machine = (machine or platform.machine()).lower()
    return list(VARIANTS) if machine in ("x86_64", "amd64") else ["generic"]


def sources_digest() -> int:
    """64 bits of the sources' bytes: a module built from other sources (an editable install whose C++
    was edited since) is not used."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()
    return int(digest[:16], 16)


def compile_flags(isa: str) -> list[str]:
    # -fopenmp: without it at::parallel_for compiles to a serial loop (measured: one core busy)
    return ["-O3", "-fopenmp", *VARIANTS[isa], f"-DHARDY_SOURCES_DIGEST={sources_digest():#x}ULL"]


def openmp_link_flags(torch_lib: Path) -> list[str]:
    """Link flags that give the kernels torch's own OpenMP runtime: a wheel that bundles libgomp under a
    name of its own would otherwise leave `-fopenmp` to link the system's copy too, and a process would
    run two runtimes with two thread pools competing for the cores."""
    bundled = sorted(Path(torch_lib).glob("libgomp*.so*"))
    if not bundled:  # a torch linked against the system's runtime: -fopenmp finds that same one
        return ["-fopenmp"]
    return [f"-L{torch_lib}", f"-l:{bundled[0].name}", f"-Wl,-rpath,{torch_lib}"]
