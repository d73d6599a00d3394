"""Where the pairing secret comes from (docs/security.md): ``VLLM_AFD_SECRET`` or the file ``secret_file``
names, read here and only here; the wire's pairing proof uses it (wire/auth.py). Its content never
appears in a message."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

__all__ = ["MAX_SECRET_BYTES", "SECRET_ENV", "check_secret_file", "load_secret"]

SECRET_ENV = "VLLM_AFD_SECRET"
# A secret file larger than this is not a secret (a wrong path): refused before it is read whole.
MAX_SECRET_BYTES = 64 * 1024


def check_secret_file(path: str) -> bytes:
    """The secret held by ``path``: a readable regular file, at most 64 KiB, non-empty once trailing line
    ends are stripped; else ``ValueError`` naming the path and the fix (the content is never shown)."""
    where = f"AFD secret_file {path!r}"
    try:
        info = os.stat(path)  # NOTE: follows links: a Kubernetes Secret volume's files are links
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file; expected a file holding the shared secret. "
                             "Point secret_file at the mounted secret's file")
        if info.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"{where} holds {info.st_size} bytes; expected a secret of at most "
                             f"{MAX_SECRET_BYTES} bytes. Check the path (e.g. `openssl rand -hex 32 > FILE`)")
        with open(path, "rb") as handle:
            key = handle.read(MAX_SECRET_BYTES + 1).rstrip(b"\r\n")
    except OSError as exc:
        raise ValueError(f"{where} cannot be read ({exc.strerror or exc}); expected a file this user can "
                         "read. Fix the path or its permissions") from exc
    if not key:
        raise ValueError(f"{where} is empty; expected the shared secret (e.g. `openssl rand -hex 32 > FILE`), "
                         "the same on both roles")
    return key


def load_secret(secret_file: str, environ: Mapping[str, str] = os.environ) -> tuple[bytes, str] | None:
    """The shared secret from ``VLLM_AFD_SECRET`` or ``secret_file`` and where it came from (for messages:
    "VLLM_AFD_SECRET" or "secret_file <path>"); None when neither is set.

    Both set is an error (which one would win is a guess), and so is an empty variable.
    """
    value = environ.get(SECRET_ENV)
    if value is not None and secret_file:
        raise ValueError(f"AFD secret: both {SECRET_ENV} and secret_file ({secret_file!r}) are set; expected "
                         f"one. Unset {SECRET_ENV} or remove secret_file from additional_config[\"afd\"]")
    if value is not None:
        if not value.strip():
            raise ValueError(f"AFD secret: {SECRET_ENV} is set but empty; expected the shared secret, the same "
                             f"on both roles. Set it, or unset it to run unauthenticated")
        return value.encode(), SECRET_ENV
    if secret_file:
        return check_secret_file(secret_file), f"secret_file {secret_file}"
    return None
