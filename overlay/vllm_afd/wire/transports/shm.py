"""Pages of POSIX shared memory for the IPC transport: its flags (``ipc.py``, one page per data subgroup)
and its control mailboxes (``mailbox.py``, one page per control pair).

The FFN of a data subgroup creates the page in ``/dev/shm``; every member maps it and registers it for
its GPU, which then writes and waits on the flags with stream memory operations. The host reads and
writes the same words with plain loads and stores, which is how ``abort()`` releases a device wait
without any CUDA call. The file is unlinked once every member mapped it, so nothing outlives the run.

A page's name reaches the other members through the rendezvous store, which any client can write: so
``attach`` accepts only a name of the creator's own pattern (``SHM_NAME``: no separator, no ``..``,
bounded length) before opening it, opens it with ``O_NOFOLLOW``, and maps it only when it is a regular
file of exactly the size its creator gave it; anything else is ``AFDProtocolError``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import stat
from typing import Any

from vllm_afd.wire.errors import AFDProtocolError

__all__ = ["FlagBlock", "SHM_DIR", "SHM_NAME", "check_shm_name"]

NAME = "P2pIpcAFDConnector"
SHM_DIR = "/dev/shm"
# What ``FlagBlock.create`` names its files: afd-ipc-<pid>-<8 hex digits>, nothing else.
SHM_NAME = re.compile(r"afd-ipc-[0-9]{1,10}-[0-9a-f]{8}")


def check_shm_name(name: Any, what: str) -> str:
    """``name`` if it is a page name ``FlagBlock.create`` could have made, else ``AFDProtocolError``."""
    if not isinstance(name, str) or SHM_NAME.fullmatch(name) is None:
        raise AFDProtocolError(
            f"{NAME}: {what} names the shared-memory page {name!r:.80}; expected a name of the form "
            f"afd-ipc-<pid>-<8 hex digits> in {SHM_DIR} (no path). Another client wrote the rendezvous store, or "
            "the roles run different vllm_afd versions: run the same version and keep the store port private"
        )
    return name


def page_bytes(nbytes: int) -> int:
    """The size of a page made for ``nbytes``: whole pages of this host."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class FlagBlock:
    """32-bit flags in one file of /dev/shm, mapped by every member of a data subgroup."""

    def __init__(self, name: str, fd: int, owner: bool) -> None:
        self.name, self.owner = name, owner
        try:
            self.nbytes = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self._anchor: Any = ctypes.c_char.from_buffer(self._map)  # an export: the map stays while in use
        self.address = ctypes.addressof(self._anchor)
        self._words = memoryview(self._map).cast("I")

    @classmethod
    def create(cls, nbytes: int) -> FlagBlock:
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"{NAME}: {SHM_DIR} does not exist; the flags live in POSIX shared memory. "
                               "Mount a tmpfs there, or use P2pGlooAFDConnector")
        name = f"afd-ipc-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, page_bytes(nbytes))  # zero-filled: every flag EMPTY
            return cls(name, fd, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, name: Any, nbytes: int) -> FlagBlock:
        """Map the page ``name`` (as read from the store) that its creator made for ``nbytes``."""
        path = os.path.join(SHM_DIR, check_shm_name(name, "the FFN's record"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise RuntimeError(
                f"{NAME}: the FFN's flag page {path} is not visible here; expected both roles to share one "
                "/dev/shm (one host and container, or containers started with --ipc=host). Use "
                "P2pNcclAFDConnector across hosts"
            ) from exc
        except OSError as exc:  # ELOOP: a symbolic link where the page should be
            raise AFDProtocolError(f"{NAME}: cannot open the shared-memory page {path} ({exc}); expected a "
                                   "regular file the FFN created. Keep the store port private") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != page_bytes(nbytes):
                kind = "a regular file" if stat.S_ISREG(info.st_mode) else "not a regular file"
                raise AFDProtocolError(
                    f"{NAME}: the shared-memory page {path} is {kind} of {info.st_size} bytes; expected the FFN's page "
                    f"of {page_bytes(nbytes)} bytes. Run the same vllm_afd version on both roles"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, owner=False)

    def write(self, index: int, value: int) -> None:
        self._words[index] = value

    def read(self, index: int) -> int:
        return self._words[index]

    def bytes_view(self) -> memoryview:
        """The page as bytes (the control mailbox, mailbox.py); release it before ``close()``."""
        return memoryview(self._map)

    def unlink(self) -> None:
        """Remove the file (its mappings stay valid); the owner does it once every member mapped it."""
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._words.release()
        self._anchor = None
        self._map.close()
