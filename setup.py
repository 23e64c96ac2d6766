"""Builds hardy's quantized decode kernels with the package: a torch C++ extension per vector ISA
(src/hardy/compress/kernel_build.py lists them and their flags). Everything else is in pyproject.toml.

The kernels are compiled against the torch in the build environment, whose C++ ABI is per version:
`pip install --no-build-isolation .` builds against the torch already installed (the Makefile does);
plain `pip install .` builds against the torch pip fetches for the build, and where that differs from
the one installed, hardy compiles the kernels again on first use. A build that fails (no compiler)
leaves the package installable: quantized layers then use the PyTorch path, said once at run time.
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kernel_build", HERE / "src" / "hardy" / "compress" / "kernel_build.py")
kernel_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_build)


def kernel_extensions():
    """(ext_modules, cmdclass) for the kernels, or none where the build environment has no torch."""
    if os.environ.get("HARDY_NO_KERNELS"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("hardy: no torch in the build environment; the kernels will be compiled on first use", file=sys.stderr)
        return [], {}

    class OptionalKernels(BuildExtension):
        """A kernel build that fails is reported and skipped, not the install's failure."""

        def build_extension(self, ext):
            base = self.build_temp  # each ISA's objects apart: the variants share their sources' names
            self.build_temp = os.path.join(base, ext.name.rsplit("_", 1)[-1])
            try:
                super().build_extension(ext)
            except Exception as e:  # compiler or ninja failures surface as several exception types
                line = (str(e).strip().splitlines() or ["no detail"])[0][:200]
                print(f"hardy: the {ext.name} kernels did not build ({line}); hardy compiles them on first "
                      "use or uses the PyTorch path", file=sys.stderr)
            finally:
                self.build_temp = base

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    sources = [str(p.relative_to(HERE)) for p in kernel_build.SOURCES]
    extensions = [CppExtension(kernel_build.module_name(isa), sources, extra_compile_args=kernel_build.compile_flags(isa),
                               extra_link_args=kernel_build.openmp_link_flags(torch_lib))
                  for isa in kernel_build.variants_for()]
    return extensions, {"build_ext": OptionalKernels}


ext_modules, cmdclass = kernel_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
