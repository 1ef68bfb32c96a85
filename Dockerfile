# fleetrun runtime image: Python slim + CPU torch by default; a CUDA base via build args.
# The Kubernetes manifests fleetrun renders run `fleetrun pod ...` in it (WORKDIR holds
# examples/ and configs/, so entrypoint paths like examples/dp/train.py resolve).
# NOT BUILT on the development machines (no Docker engine there); tests/test_k8s_manifests.py only
# parses this file. Kept minimal.
#   CPU : docker build -t fleetrun:0.1.0 .
#   CUDA: docker build --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t fleetrun:0.1.0-cuda .
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# python:*-slim has python3 + venv; the CUDA bases have neither. A venv either way (the Ubuntu
# system Python refuses pip installs, PEP 668).
RUN python3 -m venv /opt/venv 2>/dev/null || (apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv)

WORKDIR /opt/fleetrun
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
# setup.py* : the optional C kernels of ps_server (skipped without a compiler: numpy path).
COPY pyproject.toml setup.py* README.md constraints.txt ./
COPY collective ./collective
COPY fleet ./fleet
COPY launcher ./launcher
COPY ps_server ./ps_server
# Every other dependency pinned by constraints.txt (torch==2.13.0 is met by the wheel above).
# gcc only while installing: it compiles ps_server's C kernels (python:*-slim ships Python.h),
# then goes; without it the install still works and ps_server runs its numpy path.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install -c constraints.txt ".[k8s]" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
    && python -c "import fleet, launcher, collective, ps_server; print('fleetrun image ok')"
COPY examples ./examples
COPY configs ./configs

# Non-root; log_dir (default log/) must be writable by it.
RUN useradd --create-home --uid 1000 fleet && mkdir -p log && chown fleet:fleet log
USER 1000
ENTRYPOINT ["fleetrun"]
CMD ["--help"]
