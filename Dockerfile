# fleetrun runtime image: Python slim + CPU torch by default; CUDA via build args.
# It cannot be built on the development machines (no Docker engine there); kept minimal.
#   CPU : docker build -t fleetrun:0.1.0 .
#   CUDA: docker build --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t fleetrun:0.1.0-cuda .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CUDA base images ship no pip; python:*-slim does. Install python3-pip only when missing.
RUN command -v pip >/dev/null 2>&1 || (apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/*)

WORKDIR /opt/fleetrun
RUN python3 -m pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md constraints.txt ./
COPY collective ./collective
COPY fleet ./fleet
COPY launcher ./launcher
COPY ps_server ./ps_server
RUN python3 -m pip install -c constraints.txt . \
    && python3 -c "import fleet, launcher, collective; print('fleetrun image ok')"
COPY examples ./examples
COPY configs ./configs

RUN useradd --create-home --uid 1000 fleet
USER fleet
ENTRYPOINT ["fleetrun"]
CMD ["--help"]
