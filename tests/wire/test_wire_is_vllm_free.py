"""vllm_afd.wire imports no vLLM: every module of the package, imported in a fresh interpreter.

The wire is what both roles must agree on byte for byte; keeping vLLM out of it keeps it testable
without vLLM and keeps vLLM's import side effects out of the connector (docs/architecture.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"

# Imports every module of a package (walked with pkgutil) and prints the module names and any
# vLLM module that ended up in sys.modules; argv[1] names the package.
PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [package.__name__] + [
    info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
]
for name in names:
    importlib.import_module(name)
vllm = sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm."))
print(json.dumps({"modules": names, "vllm": vllm}))
"""


def probe(package: str, *path: Path) -> dict:
    """Module names of ``package`` and the vLLM modules importing all of them loaded, from a fresh interpreter."""
    search = [*map(str, path), str(OVERLAY), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, search))}
    result = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True, env=env,
                            timeout=300, check=False)
    assert result.returncode == 0, f"importing {package} failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_wire_module_imports_vllm():
    report = probe("vllm_afd.wire")

    modules, vllm = report["modules"], report["vllm"]

    assert vllm == [], f"vllm_afd.wire pulled in vLLM: {vllm[:5]}"
    for expected in ("placement", "topology", "messages", "steps", "handshake", "rendezvous", "watchdog",
                     "errors", "connector", "transport", "transports.gloo", "transports.nccl"):
        assert f"vllm_afd.wire.{expected}" in modules  # the walk reached every module


def test_the_probe_catches_a_vllm_import_in_a_nested_module(tmp_path):
    """A stand-in ``vllm`` and a package whose sub-subpackage imports it: the probe must report it."""
    for relative, text in {
        "vllm/__init__.py": "",
        "vllm/config.py": "",
        "fake_wire/__init__.py": "",
        "fake_wire/transports/__init__.py": "",
        "fake_wire/transports/leaky.py": "import vllm.config\n",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)

    report = probe("fake_wire", tmp_path)

    assert "fake_wire.transports.leaky" in report["modules"]
    assert report["vllm"] == ["vllm", "vllm.config"]
