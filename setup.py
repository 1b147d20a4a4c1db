"""megatron-rl: RL post-training of LLMs with correct KL regularization, on megatron-core.

The optional C++/CUDA extension `megatron_rl._C` is built from csrc/:
- the CPU kernels always (a CPU-only build must succeed);
- the CUDA kernels only when nvcc is found and the installed torch is a CUDA build,
  or when MEGATRON_RL_FORCE_CUDA=1.
Set MEGATRON_RL_NO_EXT=1 to skip the extension entirely (the pure-PyTorch path is used).
Install with `pip install --no-build-isolation -e .` so the extension builds against the
torch already installed.
"""
import glob
import os

from setuptools import find_packages, setup


def _extensions():
    if os.environ.get("MEGATRON_RL_NO_EXT") == "1":
        return [], {}
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    if not cpu_sources:
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    with_cuda = bool(cuda_sources) and (
        os.environ.get("MEGATRON_RL_FORCE_CUDA") == "1"
        or (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None)
    )
    # No -ffast-math: the kernels rely on IEEE rounding (exp range reduction, NaN propagation).
    # -Wno-psabi: GCC notes that 32-byte vector arguments have an AVX ABI; they never cross
    # a variant boundary (csrc/logprob_kl_cpu.cpp).
    cxx_flags = ["-O3", "-fopenmp", "-std=c++20", "-Wno-psabi"]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "megatron_rl._C",
            cpu_sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags + ["-DWITH_CUDA"], "nvcc": ["-O3", "-DWITH_CUDA"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "megatron_rl._C", cpu_sources, extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training of LLMs with correct KL regularization, built on megatron-core",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "megatron-core>=0.16.1", "psutil", "tqdm", "einops", "numpy",
                      "safetensors", "pyyaml"],
    extras_require={
        "hf": ["transformers", "tokenizers"],
        "tasks": ["math-verify==0.9.0", "reasoning-gym==0.1.25", "pyarrow"],
        "plots": ["matplotlib", "tensorboard"],
        "test": ["pytest"],
    },
    entry_points={
        "console_scripts": ["megatron-rl=megatron_rl.cli:main"],
        # `megatron-rl <name> ...` runs module:function(argv); megatron_rl/cli.py discovers them,
        # so the CLI never imports megatron_rl.experiments unless that command is chosen.
        "megatron_rl.commands": [
            "train=megatron_rl.train:main",
            "eval=megatron_rl.evaluation:main",
            "convert=megatron_rl.convert:main",
            "rollouts=megatron_rl.rollout.trajectory_log:main",
            "toy=megatron_rl.experiments.toy:main",
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
