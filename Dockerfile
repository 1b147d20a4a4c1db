# syntax=docker/dockerfile:1
# megatron-rl image. GPU (default): trainer (megatron-core 0.16.1 + this package and its CUDA
# kernels) and a vLLM rollout server in its own venv. CPU: the same install steps
# (scripts/docker_install.sh) on a plain Debian base, with the CPU torch and C++ kernels.
#
#   docker build -t megatron-rl .
#   docker build -t megatron-rl:sglang --build-arg INSTALL_VLLM=0 --build-arg INSTALL_SGLANG=1 .
#   docker run --gpus all --ipc=host --rm -it -v $PWD/runs:/workspace/runs megatron-rl \
#       torchrun --nproc-per-node 8 -m megatron_rl.train --config examples/<recipe>.yaml
#   bash scripts/build_image.sh      # the CPU variant, with buildah (no Docker daemon needed),
#                                    # then the quick start and the fast tests inside it
# Usage, multi-node and SLURM: docs/launch.md; the CPU variant: docs/docker.md.
#
# Base: NGC PyTorch 25.11 (Python 3.12, CUDA 13, NCCL, cuDNN and TransformerEngine preinstalled).
# It is the container Megatron-LM's own CI runs megatron-core 0.16.1 in (docker/.ngc_version.dev
# at tag core_v0.16.1), so the torch / TransformerEngine / NCCL versions in it are the ones
# megatron-core 0.16.1 was tested against. Its torch is kept as it is. Any other base with a
# `python` whose `pip` installs into the image's Python works too: one without torch (the CPU
# variant, e.g. Debian bookworm + python3-pip + PIP_BREAK_SYSTEM_PACKAGES=1) gets the CPU torch.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
# TOKENIZERS_PARALLELISM is no secret (hadolint matches "TOKEN")
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# The install steps live in scripts/docker_install.sh, shared with the CPU variant.
WORKDIR /opt/megatron-rl
COPY scripts/docker_install.sh scripts/
COPY requirements-cpu.txt ./

# --- 1. rollout servers, each in its own venv (docker_install.sh says why) -----------------------
# vLLM is the default: plain wheels, no stand-ins, and the engine megatron-rl's real-server
# tests cover most (tied-embedding weight-sync fix, restart); SGLang is one build arg away.
# Both are CUDA builds: the CPU variant sets INSTALL_VLLM=0.
ARG INSTALL_VLLM=1
ARG VLLM_VERSION=0.32.0
ARG INSTALL_SGLANG=0
ARG SGLANG_VERSION=0.5.23
RUN --mount=type=cache,target=/root/.cache/pip bash scripts/docker_install.sh servers
# The engines find their server interpreter here (megatron_rl/rollout/{vllm,sglang}_engine.py).
ENV MEGATRON_RL_VLLM_PYTHON=/opt/venv-vllm/bin/python \
    MEGATRON_RL_SGLANG_PYTHON=/opt/venv-sglang/bin/python

# --- 2. trainer dependencies, into the image's Python --------------------------------------------
# The base's torch (NGC's CUDA build) is kept and frozen as a constraint; a base without torch
# (the CPU variant) gets requirements-cpu.txt's pin as its +cpu build, from TORCH_FIND_LINKS
# (a folder with the wheel, mounted into the build) or TORCH_INDEX_URL. Then megatron-core and
# requirements-cpu.txt's other pins; g++ and the Python headers if the base lacks them.
ARG TORCH_FIND_LINKS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=cache,target=/root/.cache/pip bash scripts/docker_install.sh deps

# --- 3. this package and its C++ / CUDA extension ----------------------------------------------
# The kernels change far less often than the Python code: build them from setup.py + csrc/ alone,
# then copy the rest, so an edit to a .py file reuses this (slow, nvcc) layer. With a CUDA torch
# the build fails unless the CUDA kernels are in the extension.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG MAX_JOBS=8
COPY setup.py ./
COPY csrc/ csrc/
COPY megatron_rl/__init__.py megatron_rl/__init__.py
RUN bash scripts/docker_install.sh package
COPY . .
# An editable install maps `megatron_rl` to this directory; PYTHONPATH also covers the tools/ and
# tests/ scripts that import it from a checkout, and the vLLM server's worker extension.
ENV PYTHONPATH=/opt/megatron-rl
# .venv as a view of the image's Python (so scripts/quickstart.sh and scripts/test.sh run as
# they are), and an import check.
RUN bash scripts/docker_install.sh finish

WORKDIR /workspace
CMD ["bash"]
