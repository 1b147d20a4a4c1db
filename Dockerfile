# syntax=docker/dockerfile:1
# megatron-rl GPU image: trainer (megatron-core 0.16.1 + this package and its CUDA kernels) and a
# vLLM rollout server in its own venv.
#
#   docker build -t megatron-rl .
#   docker build -t megatron-rl:sglang --build-arg INSTALL_VLLM=0 --build-arg INSTALL_SGLANG=1 .
#   docker run --gpus all --ipc=host --rm -it -v $PWD/runs:/workspace/runs megatron-rl \
#       torchrun --nproc-per-node 8 -m megatron_rl.train --config examples/<recipe>.yaml
# Usage, multi-node and SLURM: docs/launch.md.
#
# Base: NGC PyTorch 25.11 (Python 3.12, CUDA 13, NCCL, cuDNN and TransformerEngine preinstalled).
# It is the container Megatron-LM's own CI runs megatron-core 0.16.1 in (docker/.ngc_version.dev
# at tag core_v0.16.1), so the torch / TransformerEngine / NCCL versions in it are the ones
# megatron-core 0.16.1 was tested against. Override with --build-arg BASE_IMAGE=... at your risk.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
# TOKENIZERS_PARALLELISM is no secret (hadolint matches "TOKEN")
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# --- 1. rollout servers, each in its own venv -------------------------------------------------
# vLLM and SGLang wheels pin their own CUDA torch build; installed into the image's Python they
# would replace NGC's torch (and break TransformerEngine). In a venv they cannot, and the trainer
# only talks to them over HTTP (it launches `$MEGATRON_RL_VLLM_PYTHON -m vllm.entrypoints...`),
# so nothing of theirs needs to import beside megatron-core. The image's PIP_CONSTRAINT (NGC pins
# its torch build there) is cleared for these installs only.
# vLLM is the default: plain wheels, no stand-ins, and the engine megatron-rl's real-server
# tests cover most (tied-embedding weight-sync fix, restart); SGLang is one build arg away.
ARG INSTALL_VLLM=1
ARG VLLM_VERSION=0.32.0
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "${INSTALL_VLLM}" = "1" ]; then \
        python -m venv /opt/venv-vllm && \
        PIP_CONSTRAINT="" /opt/venv-vllm/bin/pip install "vllm==${VLLM_VERSION}" && \
        /opt/venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"; \
    fi
ARG INSTALL_SGLANG=0
ARG SGLANG_VERSION=0.5.23
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "${INSTALL_SGLANG}" = "1" ]; then \
        python -m venv /opt/venv-sglang && \
        PIP_CONSTRAINT="" /opt/venv-sglang/bin/pip install "sglang==${SGLANG_VERSION}" && \
        /opt/venv-sglang/bin/python -c "import sglang; print('sglang', sglang.__version__)"; \
    fi
# The engines find their server interpreter here (megatron_rl/rollout/{vllm,sglang}_engine.py).
ENV MEGATRON_RL_VLLM_PYTHON=/opt/venv-vllm/bin/python \
    MEGATRON_RL_SGLANG_PYTHON=/opt/venv-sglang/bin/python

# --- 2. trainer dependencies, into the image's Python --------------------------------------------
# Freeze the image's own torch / triton / TransformerEngine / NVIDIA libraries as constraints, so
# that any dependency asking for another torch fails the build instead of silently replacing it.
# megatron-core goes in with --no-deps: its only requirements (torch, numpy, packaging) are in
# the image, and pip can reject NGC's pre-release torch version string (2.x.0a0+...) against
# `torch>=2.6`. psutil and tqdm are used by megatron-core without being declared.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip list --format=freeze \
        | grep -iE '^(torch|triton|transformer[-_]engine|nvidia-|numpy|packaging)' \
        > /etc/megatron-rl-keep.txt && \
    PIP_CONSTRAINT=/etc/megatron-rl-keep.txt pip install --no-deps "megatron-core==0.16.1" && \
    PIP_CONSTRAINT=/etc/megatron-rl-keep.txt pip install \
        "psutil==7.2.2" "tqdm==4.70.1" "einops==0.8.2" "safetensors==0.8.0" "pyyaml==6.0.3" \
        "transformers==5.23.0" "tokenizers==0.23.3" \
        "math-verify==0.9.0" "reasoning-gym==0.1.25" \
        "tensorboard==2.21.0" "matplotlib==3.11.2" "pytest==9.2.0"

# --- 3. this package and its CUDA extension ----------------------------------------------------
# The kernels change far less often than the Python code: build them from setup.py + csrc/ alone,
# then copy the rest, so an edit to a .py file reuses this (slow, nvcc) layer.
WORKDIR /opt/megatron-rl
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG MAX_JOBS=8
COPY setup.py ./
COPY csrc/ csrc/
COPY megatron_rl/__init__.py megatron_rl/__init__.py
# --no-build-isolation: compile against the image's torch; --no-deps: everything is installed
# above. setup.py builds the CUDA kernels because nvcc and a CUDA torch are present (no GPU is
# needed at build time: the target architectures come from TORCH_CUDA_ARCH_LIST).
RUN TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
        pip install --no-cache-dir --no-build-isolation --no-deps -e . && \
    ls megatron_rl/_C*.so
COPY . .
# An editable install maps `megatron_rl` to this directory; PYTHONPATH also covers the tools/ and
# tests/ scripts that import it from a checkout, and the vLLM server's worker extension.
ENV PYTHONPATH=/opt/megatron-rl
# Import check without a GPU (the build has none): CUDA libraries load lazily.
RUN python -c "import megatron_rl._C, megatron.core, megatron_rl.train; print('megatron-rl ok')"

WORKDIR /workspace
CMD ["bash"]
