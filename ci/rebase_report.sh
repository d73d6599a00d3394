#!/usr/bin/env bash
# How each supported release's patch series lands on newer vLLM releases
# (scripts/apply_patches.py --rebase-report; docs/rebase-report.md explains the checks).
#   bash ci/rebase_report.sh            write docs/rebase-report.md and docs/rebase-report.json:
#                                       every series (VLLM_PIN*) on each release of $VERSIONS newer
#                                       than its pin
#   bash ci/rebase_report.sh --newest   CI's advisory step: the same for the newest vLLM on the
#                                       package index, into $OUT_DIR (default runs/, git-ignored)
#   bash ci/rebase_report.sh --check    gate, no download: the committed JSON names the current
#                                       digest of every series (else: regenerate and commit it)
# Fails only when a series does not apply to its own pin, or (--check) the committed report is
# stale.  Drift (exit 3) and conflicts (exit 1) on newer releases are reported, never a failure:
# upstream news never fails CI.  Wheels come from ~/.cache/afd-vllm-wheels, else pip download.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
MODE=${1:-docs}
pin_value() { sed -n "s/^$2[[:space:]]*=[[:space:]]*//p" "$1" | head -1; }

if [ "$MODE" = "--check" ]; then
  exec "$PY" - docs/rebase-report.json <<'CHECK'
import json, sys
from pathlib import Path
from afd_patchtool import _series  # pip install -e scripts (ci/setup_env.sh)
report = Path(sys.argv[1])
if not report.is_file():
    sys.exit(f"{report}: missing; expected the committed rebase report. Run bash ci/rebase_report.sh.")
stale = []
release = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
targets = {s["version"] for s in json.loads(report.read_text())["sections"]}
for path in _series.pin_files(Path(".")):
    pin = _series.read_pin(path)
    if not any(release(t) > release(pin["version"]) for t in targets):
        continue  # the newest series: no release of the report is newer than its pin
    digest = _series.series_sha256(_series.load_series(_series.series_dir(path, pin)))
    sections = [s for s in json.loads(report.read_text())["sections"] if s["pin"]["version"] == pin["version"]]
    if not sections or any(s["series_sha256"] != digest for s in sections):
        stale.append(f"{path.name} (series {digest[:16]})")
if stale:
    sys.exit(f"{report}: stale for {', '.join(stale)}; expected every section to name its series' current "
             "digest. Regenerate it: bash ci/rebase_report.sh, and commit docs/rebase-report.md and .json.")
print(f"OK: {report} is current for every series")
CHECK
fi

if [ "$MODE" = "--newest" ]; then
  NEWEST=$("$PY" -m pip index versions vllm 2>/dev/null | sed -n 's/^vllm (\([^)]*\)).*/\1/p' | head -1)
  if [ -z "$NEWEST" ]; then
    echo "ci/rebase_report.sh --newest: cannot read the newest vllm from the package index (pip index" \
         "versions vllm); advisory step skipped." >&2
    exit 0
  fi
  VERSIONS=$NEWEST
  OUT_DIR=${OUT_DIR:-runs}
  OUT=$OUT_DIR/rebase-report-newest.md
else
  VERSIONS=${VERSIONS:-"0.31.0 0.32.0 0.33.0 0.34.0"}
  OUT=${OUT:-docs/rebase-report.md}
fi
JSON=${OUT%.md}.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat > "$tmp/report.md" <<HEADER
# Rebase report: the patch series on newer vLLM releases

Generated $(date -u +%Y-%m-%d) by \`ci/rebase_report.sh\` (\`scripts/apply_patches.py --rebase-report\`)
for: ${VERSIONS}, one section per series (VLLM_PIN*) and newer release; the same as data in
\`$(basename "$JSON")\`.  Statuses: \`clean\` (exact), \`offset N\`, \`needs fuzz N\` (a diagnostic:
fuzz is never used to build), \`already applied\`, \`already upstream\` (drop the patch),
\`conflict\`, \`ambiguous\`.  Semantic findings (what each kind catches:
docs/patch-tooling.md#rebase-report) each come with an action.  Per-section exit: 0 no drift,
3 drift, 1 conflicts.  How a maintainer acts on it: docs/releases.md, "When vLLM releases".
HEADER

num=0
heading=
for pin_file in VLLM_PIN VLLM_PIN-*; do
  [ -f "$pin_file" ] || continue
  pinned=$(pin_value "$pin_file" version)
  flavor=cpu; case ",$(pin_value "$pin_file" platforms | tr -d ' ')," in ,,|*,cpu,*) ;; *) flavor=cuda ;; esac
  echo "== $pin_file: the series must apply to its pin ($flavor wheel, fuzz 0)"
  "$PY" scripts/apply_patches.py --check --pin "$pin_file" --flavor $flavor -q
  for version in $VERSIONS; do
    newer=$(printf '%s\n%s\n' "$pinned" "$version" | sort -V | tail -1)
    [ "$newer" = "$version" ] && [ "$version" != "$pinned" ] || continue
    num=$((num + 1))
    echo "== rebase report: the $pinned series on vLLM $version"
    rc=0
    "$PY" scripts/apply_patches.py --rebase-report "$version" --pin "$pin_file" \
      --out "$tmp/$num.md" --report "$tmp/$num.json" || rc=$?
    case $rc in
      0|1|3) ;;  # no drift / conflicts / drift: reported, not a failure
      *) echo "ci/rebase_report.sh: the report of the $pinned series on $version failed (exit $rc);" \
              "expected 0, 1 or 3." >&2
         exit "$rc" ;;
    esac
    if [ "$heading" != "$pin_file" ]; then
      printf '\n# The vLLM %s series (%s)\n' "$pinned" "$pin_file" >> "$tmp/report.md"
      heading=$pin_file
    fi
    { echo; cat "$tmp/$num.md"; } >> "$tmp/report.md"
  done
done
if [ "$num" = 0 ]; then
  echo "ci/rebase_report.sh: no release in ($VERSIONS) is newer than a pin; nothing to report."
  exit 0
fi
"$PY" - "$tmp" "$num" > "$tmp/report.json" <<'MERGE'
import datetime, json, sys
from pathlib import Path
sections = [json.loads((Path(sys.argv[1]) / f"{k}.json").read_text()) for k in range(1, int(sys.argv[2]) + 1)]
print(json.dumps({"generated": datetime.date.today().isoformat(), "sections": sections}, indent=1))
MERGE
mkdir -p "$(dirname "$OUT")"
mv "$tmp/report.md" "$OUT"
mv "$tmp/report.json" "$JSON"
echo "OK: wrote $OUT and $JSON ($num sections)"
