"""The patch tool behind `scripts/apply_patches.py` (its CLI): series, placement, diff writer, modes.

`_series` (pin, series, patch files), `_placement` (hunks on in-memory files), `_diff` (patch writer),
`_modes` (check/build/verify/apply-to), `_wheel`, `_tree`, `_lint`, `_refresh`, `_rebase` + `_semantic`
(rebase report), `_report`, `_upstream`.  Importable without installing: `python scripts/apply_patches.py`
puts scripts/ on sys.path; `pip install -e scripts` (ci/setup_env.sh) makes it importable for the tests.
"""
