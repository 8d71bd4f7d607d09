"""Builds the optional compiled extension ``vit_kernels._C`` from csrc/.

C++ sources (csrc/*.cpp) always; CUDA sources (csrc/cuda/*.cu) when torch has CUDA and nvcc is
found. Environment: VIT_KERNELS_SKIP_EXT=1 skips the extension, MAX_JOBS bounds parallel compiles,
TORCH_CUDA_ARCH_LIST picks GPU architectures (default "8.0;9.0"). Without torch importable at
build time, or without sources, the package installs as pure Python.
"""

import glob
import os
import sys

from setuptools import setup


def extension_modules():
    if os.environ.get("VIT_KERNELS_SKIP_EXT", "0") not in ("", "0"):
        return [], {}
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    if not cpp_sources:
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("vit-kernels: torch is not importable at build time; skipping vit_kernels._C", file=sys.stderr)
        return [], {}
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    compile_args = {"cxx": ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        compile_args["nvcc"] = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo"]
        extension = cpp_extension.CUDAExtension(
            "vit_kernels._C", cpp_sources + cuda_sources, extra_compile_args=compile_args,
            define_macros=[("VIT_KERNELS_WITH_CUDA", "1")], extra_link_args=["-fopenmp"],
        )
    else:
        extension = cpp_extension.CppExtension(
            "vit_kernels._C", cpp_sources, extra_compile_args=compile_args, extra_link_args=["-fopenmp"]
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [extension], {"build_ext": build_ext}


ext_modules, cmdclass = extension_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
