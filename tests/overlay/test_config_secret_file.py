"""``secret_file`` (docs/config.md, validation step 13; docs/security.md): checked at parse time, before any
resource; only the path is configuration, the secret never shows in the parsed config."""

from __future__ import annotations

import os

import pytest

from vllm_afd.config import AFDConfig

SECRET = "0f3c-the-shared-secret-9d1e"


def test_a_readable_file_is_accepted_and_only_its_path_is_in_the_config(tmp_path):
    path = tmp_path / "afd-secret"
    path.write_text(SECRET + "\n")

    config = AFDConfig.from_mapping({"role": "ffn", "secret_file": str(path)})

    assert config.secret_file == str(path) and config.to_mapping()["secret_file"] == str(path)
    assert SECRET not in repr(config) and SECRET not in repr(config.to_mapping())
    assert AFDConfig.from_mapping(config.to_mapping()) == config


def test_a_link_to_the_file_is_followed_as_kubernetes_mounts_secrets(tmp_path):
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "afd-secret").write_text(SECRET)
    os.symlink(tmp_path / "..data" / "afd-secret", tmp_path / "afd-secret")

    config = AFDConfig.from_mapping({"secret_file": str(tmp_path / "afd-secret")})

    assert config.secret_file.endswith("afd-secret")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: None, "cannot be read (No such file or directory); expected a file this user can read"),
    (lambda p: p.mkdir(), "is not a regular file; expected a file holding the shared secret"),
    (lambda p: p.write_text(""), "is empty; expected the shared secret"),
    (lambda p: p.write_text("\n\r\n"), "is empty; expected the shared secret"),
    (lambda p: p.write_bytes(b"x" * (64 * 1024 + 1)), "holds 65537 bytes; expected a secret of at most 65536 bytes"),
])
def test_an_unusable_secret_file_is_a_clear_error_at_parse_time(tmp_path, make, message):
    path = tmp_path / "afd-secret"
    make(path)

    with pytest.raises(ValueError, match="AFD secret_file '.*afd-secret' ") as raised:
        AFDConfig.from_mapping({"secret_file": str(path)})

    assert message in str(raised.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_file_is_refused_without_showing_its_content(tmp_path):
    path = tmp_path / "afd-secret"
    path.write_text(SECRET)
    path.chmod(0)

    with pytest.raises(ValueError, match="cannot be read \\(Permission denied\\)") as raised:
        AFDConfig.from_mapping({"secret_file": str(path)})

    assert SECRET not in str(raised.value)


def test_secret_file_must_be_a_string():
    with pytest.raises(TypeError, match="secret_file must be a string, got 3"):
        AFDConfig.from_mapping({"secret_file": 3})
