"""Builds the optional compiled extension ``vit_kernels._C`` from csrc/.

C++ sources (csrc/*.cpp) always; CUDA sources (csrc/cuda/*.cu) too when torch has CUDA and the CUDA
toolkit can build and link against it: nvcc under CUDA_HOME, a linkable ``libcudart.so`` in the
library directories torch links from, and the same CUDA major version as torch. Otherwise the C++
extension alone is built and the reason printed. The extension is optional: when its build fails,
the package installs as pure Python (the ``torch`` backend) and says why.

Environment: VIT_KERNELS_SKIP_EXT=1 skips the extension; VIT_KERNELS_CUDA=0 builds it without CUDA,
VIT_KERNELS_CUDA=1 builds the CUDA sources without the toolkit checks; MAX_JOBS bounds parallel
compiles; TORCH_CUDA_ARCH_LIST picks GPU architectures (default "8.0;9.0").
"""

import glob
import os
import re
import subprocess
import sys

from setuptools import setup

EXTENSION = "vit_kernels._C"
CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
# No --use_fast_math: its approximate tanhf, expf and division cost float32 GELU 4 to 29 units in the last
# place on an H200 (PyTorch's own: 0.5 to 2); the kernels are memory-bound, the exact forms cost little.
NVCC_FLAGS = ["-O3", "-std=c++20", "-lineinfo"]


def say(message: str) -> None:
    print(f"vit-kernels: {message}", file=sys.stderr)


def env_flag(name: str) -> "bool | None":
    """True / False for 1 / 0, None when unset; anything else is an error naming the variable."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"vit-kernels: {name} must be 0 or 1, got {value!r}")
    return value == "1"


def cuda_toolkit_problem(torch, cpp_extension) -> "str | None":
    """Why the CUDA sources cannot be built and linked here, or None when they can."""
    if torch.version.cuda is None:
        return "torch has no CUDA"
    home = cpp_extension.CUDA_HOME
    if home is None:
        return "no CUDA toolkit found (set CUDA_HOME)"
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.access(nvcc, os.X_OK):
        return f"no nvcc at {nvcc}"
    try:
        banner = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"{nvcc} --version failed: {error}"
    found = re.search(r"release (\d+)\.(\d+)", banner)
    if found and found.group(1) != torch.version.cuda.split(".")[0]:
        return f"nvcc is CUDA {found.group(1)}.{found.group(2)} but torch was built with CUDA {torch.version.cuda}"
    library_dirs = cpp_extension.library_paths(device_type="cuda")
    if not any(os.path.exists(os.path.join(d, "libcudart.so")) for d in library_dirs):
        return f"no linkable libcudart.so in {', '.join(library_dirs)} (under CUDA_HOME={home})"
    return None


def make_extension(cpp_extension, with_cuda: bool):
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        return cpp_extension.CUDAExtension(
            EXTENSION,
            cpp_sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            define_macros=[("VIT_KERNELS_WITH_CUDA", "1")],
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        EXTENSION, cpp_sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"]
    )


def optional_build_ext(cpp_extension):
    """torch's BuildExtension that never fails the install: a failed CUDA build is retried as C++
    only, a failed C++ build leaves the package pure Python; each step says why."""
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class OptionalBuildExtension(base):
        def run(self):
            while self.extensions:
                try:
                    return super().run()
                except Exception as error:  # noqa: BLE001 (any compiler or linker failure)
                    with_cuda = any(source.endswith(".cu") for source in self.extensions[0].sources)
                    say(f"building {EXTENSION} {'with CUDA ' if with_cuda else ''}failed: {error}")
                    if with_cuda:
                        say(f"retrying {EXTENSION} without CUDA")
                        self.extensions = [make_extension(cpp_extension, with_cuda=False)]
                    else:
                        say(f"installing without {EXTENSION}: the torch backend runs every op")
                        self.extensions = []
            return None

    return OptionalBuildExtension


def extension_modules():
    if env_flag("VIT_KERNELS_SKIP_EXT"):
        return [], {}
    if not glob.glob("csrc/*.cpp"):
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        say(f"torch is not importable at build time; skipping {EXTENSION}")
        return [], {}
    forced = env_flag("VIT_KERNELS_CUDA")
    has_cuda_sources = bool(glob.glob("csrc/cuda/*.cu"))
    if forced is None:
        problem = "no CUDA sources" if not has_cuda_sources else cuda_toolkit_problem(torch, cpp_extension)
        with_cuda = problem is None
        if torch.version.cuda is not None and problem is not None:
            say(f"building {EXTENSION} without CUDA: {problem} (VIT_KERNELS_CUDA=1 forces it)")
    else:
        with_cuda = forced and has_cuda_sources
        say(f"VIT_KERNELS_CUDA={int(forced)}: building {EXTENSION} {'with' if with_cuda else 'without'} CUDA")
    extension = make_extension(cpp_extension, with_cuda)
    return [extension], {"build_ext": optional_build_ext(cpp_extension)}


ext_modules, cmdclass = extension_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
