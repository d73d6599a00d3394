#!/usr/bin/env bash
# The project's test command (README): set up .venv, run the gates, then every test tier.
#   tier 1  gates: monkeypatch AST check, patch lint, zero-fuzz check on the pin, patches/ up to date
#   tier 2  fast tests (unit, patch engine, contracts, models in-process)
#   tier 3  e2e tests: real vLLM processes on loopback (marked e2e; slow)
# Pass pytest arguments after `--`, e.g. `bash ci/test.sh -- -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_env.sh
PY=${AFD_VENV:-.venv}/bin/python

echo "== tier 1: gates"
"$PY" ci/check_no_monkeypatch.py overlay scripts tests/harness
"$PY" scripts/apply_patches.py --lint
"$PY" scripts/apply_patches.py --check --vllm ced6857 --flavor all
"$PY" scripts/apply_patches.py --refresh --dry-run --vllm ced6857 --flavor cpu   # patches/ is up to date

[ "${1:-}" = "--" ] && shift
echo "== tier 2: fast tests"
"$PY" -m pytest -m "not e2e" "$@"
echo "== tier 3: e2e tests (real vLLM processes)"
"$PY" -m pytest -m e2e "$@"
