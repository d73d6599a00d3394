"""Make ``vllm_afd`` importable from the source tree when it is not pip-installed (-e) yet."""

import importlib.util
import pathlib
import sys

if importlib.util.find_spec("vllm_afd") is None:
    # NOTE: CI installs the package with `pip install -e .`; this only serves a bare checkout.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "overlay"))
