"""Import every module of the overlay on the installed vLLM; print each failure and exit 1 if any.

CI's check for a CUDA-only release (vLLM 0.34.0), whose venv holds the patched Python tree on CPU torch
without CUDA kernels (docs/releases.md#vllm-0340): an import error is a renamed or removed vLLM name.
A module the release cannot serve must refuse with the release's own message (`--expect-refusal MODULE`).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-refusal", action="append", default=[], metavar="MODULE",
                        help="a module whose import must raise the overlay's RuntimeError naming why")
    args = parser.parse_args()
    import vllm_afd

    names = [info.name for info in pkgutil.walk_packages(vllm_afd.__path__, "vllm_afd.")]
    failures = []
    for name in names:
        try:
            importlib.import_module(name)
        except RuntimeError as error:
            if name not in args.expect_refusal or not str(error).startswith("vllm_afd: "):
                failures.append((name, traceback.format_exc()))
        except Exception:  # noqa: BLE001 — every import failure is reported, then CI fails
            failures.append((name, traceback.format_exc()))
        else:
            if name in args.expect_refusal:
                failures.append((name, "imported, but this release should refuse it\n"))
    for name, text in failures:
        print(f"== {name}\n{text}", file=sys.stderr)
    print(f"check_overlay_imports: {len(names)} modules, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
