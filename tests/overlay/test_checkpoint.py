"""vllm_afd.checkpoint: content digests of the checkpoint a rank loaded (docs/connection.md#checkpoint-digests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from vllm_afd.checkpoint import (
    DUMMY,
    SAMPLE_BYTES,
    UNKNOWN_PREFIX,
    checkpoint_digest,
    digest_config_file,
    digest_weight_files,
    weight_files,
)

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128, "num_hidden_layers": 3}
SHAPES = {"model.embed_tokens.weight": (64, 32), "model.layers.0.mlp.gate.weight": (8, 32),
          "model.layers.0.mlp.experts.0.down_proj.weight": (32, 16), "model.norm.weight": (32,)}


def write_checkpoint(directory: Path, seed: int, *, shards: int = 2, config: dict | None = None) -> Path:
    """A safetensors checkpoint of SHAPES, float32 normals from ``seed``, split over ``shards`` files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    rng = np.random.default_rng(seed)
    names = sorted(SHAPES)
    for shard in range(shards):
        tensors = {name: rng.standard_normal(SHAPES[name]).astype(np.float32) for name in names[shard::shards]}
        save_file(tensors, str(directory / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"))
    return directory


def test_unknown_digests_are_the_ones_the_handshake_skips():
    from vllm_afd.wire.handshake import UNKNOWN_DIGEST_PREFIX

    assert UNKNOWN_PREFIX == UNKNOWN_DIGEST_PREFIX


def digest(directory: Path, load_format: str = "auto"):
    return checkpoint_digest(str(directory), load_format=load_format)


def test_copies_at_different_paths_have_equal_digests(tmp_path):
    original = write_checkpoint(tmp_path / "host1" / "model", seed=0)
    copy = Path(shutil.copytree(original, tmp_path / "host2" / "elsewhere"))

    first, second = digest(original), digest(copy)

    assert (first.config_digest, first.weights_digest) == (second.config_digest, second.weights_digest)
    assert first.weights_digest.startswith("sha256:") and len(first.weights_digest) == len("sha256:") + 16
    assert (first.source, second.source) == (str(original), str(copy))


def test_another_seed_with_the_same_config_and_shapes_has_other_weights(tmp_path):
    seed0, seed1 = write_checkpoint(tmp_path / "a", seed=0), write_checkpoint(tmp_path / "b", seed=1)

    first, second = digest(seed0), digest(seed1)

    assert first.config_digest == second.config_digest
    assert first.weights_digest != second.weights_digest


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SHAPES)), delta=st.sampled_from([1e-3, 1.0, -2.0]))
@example(name="model.norm.weight", delta=1e-3)
def test_changing_any_one_tensor_changes_the_weights_digest(tmp_path_factory, name, delta):
    """A fine-tune moves every element of the tensors it touches; each tensor's sampled windows see it."""
    directory = write_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0, shards=1)
    before = digest(directory).weights_digest
    path = directory / "model-00001-of-00001.safetensors"
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    tensors[name] = tensors[name] + np.float32(delta)
    save_file(tensors, str(path))

    assert digest(directory).weights_digest != before


def test_config_formatting_does_not_matter_but_any_value_does(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(CONFIG, indent=2))
    (tmp_path / "b.json").write_text(json.dumps(dict(reversed(list(CONFIG.items())))))
    (tmp_path / "c.json").write_text(json.dumps({**CONFIG, "rms_norm_eps": 1e-5}))

    a, b, c = (digest_config_file(tmp_path / f"{name}.json") for name in "abc")

    assert a == b != c


def test_only_the_files_vllm_loads_are_digested(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"w" * 10)
    (tmp_path / "training_args.bin").write_bytes(b"t")
    (tmp_path / "extra.pt").write_bytes(b"p")

    assert [p.name for p in weight_files(tmp_path)] == ["extra.pt", "pytorch_model.bin"]

    (tmp_path / "model.safetensors").write_bytes(b"")
    assert [p.name for p in weight_files(tmp_path)] == ["model.safetensors"]


def test_a_safetensors_file_costs_its_header_plus_three_windows_per_tensor(tmp_path):
    directory = write_checkpoint(tmp_path / "m", seed=0, shards=1)
    path = directory / "model-00001-of-00001.safetensors"
    header_bytes = int.from_bytes(path.read_bytes()[:8], "little")

    _, read = digest_weight_files([path])

    assert read <= 8 + header_bytes + 3 * SAMPLE_BYTES * len(SHAPES)
    assert read < path.stat().st_size


@pytest.mark.parametrize("size", [0, 7, 100, 200_000])
def test_pickled_weight_files_are_sampled_by_size_and_windows(tmp_path, size):
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "pytorch_model.bin").write_bytes(data)
    (tmp_path / "b" / "pytorch_model.bin").write_bytes(bytes(reversed(data)) if size > 1 else b"x" * (size + 1))

    first, second = digest(tmp_path / "a"), digest(tmp_path / "b")

    assert first.weights_digest != second.weights_digest


def test_dummy_weights_are_named_and_the_config_is_still_digested(tmp_path):
    directory = write_checkpoint(tmp_path / "m", seed=0)

    result = digest(directory, load_format=DUMMY)

    assert result.weights_digest == "dummy"
    assert result.config_digest == digest(directory).config_digest


def test_a_directory_without_weights_has_an_unknown_digest_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))

    result = digest(tmp_path)

    assert result.weights_digest == f"unknown (no *.safetensors, *.bin or *.pt in {tmp_path})"
    assert result.config_digest.startswith("sha256:")


def test_a_hub_id_not_on_disk_is_unknown_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    result = checkpoint_digest("org/not-downloaded", load_format="auto", download_dir=str(tmp_path))

    assert result.source == "org/not-downloaded"
    assert result.weights_digest == result.config_digest == (
        "unknown ('org/not-downloaded' is not a local path and not in the hub cache yet)")
    assert list(tmp_path.iterdir()) == []


def test_a_hub_id_in_the_cache_digests_like_a_local_copy(tmp_path):
    local = write_checkpoint(tmp_path / "local", seed=3)
    repo = tmp_path / "cache" / "models--org--tiny"
    shutil.copytree(local, repo / "snapshots" / ("c" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)

    result = checkpoint_digest("org/tiny", load_format="auto", download_dir=str(tmp_path / "cache"))

    assert result.source == str(repo / "snapshots" / ("c" * 40))
    assert (result.config_digest, result.weights_digest) == (digest(local).config_digest, digest(local).weights_digest)


def test_build_fingerprint_carries_the_checkpoint_digests(tmp_path):
    pytest.importorskip("vllm")
    from tests.connectors._vllm_configs import TINY_QWEN3_MOE, make_vllm_config

    from vllm_afd.config import parse_afd_config
    from vllm_afd.connect import build_fingerprint
    from vllm_afd.wire.placement import Placement

    directory = write_checkpoint(tmp_path / "qwen", seed=0, config=TINY_QWEN3_MOE)
    vllm_config = make_vllm_config(directory, role="ffn", connector="P2pGlooAFDConnector")

    fingerprint = build_fingerprint(vllm_config, parse_afd_config(vllm_config), Placement("ffn", 0, 1, 1))

    assert fingerprint.checkpoint == str(directory)
    assert (fingerprint.config_digest, fingerprint.weights_digest) == (
        digest(directory).config_digest, digest(directory).weights_digest)


def test_an_unknown_digest_is_logged_with_the_fix(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    caplog.set_level("WARNING", logger="vllm_afd.checkpoint")

    digest(tmp_path)

    assert [record.getMessage() for record in caplog.records] == [
        f"AFD checkpoint {tmp_path}: not compared at the handshake: unknown (no *.safetensors, *.bin or *.pt in "
        f"{tmp_path}). Pass a local path, or download the checkpoint before starting, to have it checked"]
