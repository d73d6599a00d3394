"""Pages of POSIX shared memory for the IPC transport: its flags (``ipc.py``, one page per data subgroup)
and its control mailboxes (``mailbox.py``, one page per control pair).

The FFN of a data subgroup creates the page in ``/dev/shm``; every member maps it and registers it for
its GPU, which then writes and waits on the flags with stream memory operations. The host reads and
writes the same words with plain loads and stores, which is how ``abort()`` releases a device wait
without any CUDA call. The file is unlinked once every member mapped it, so nothing outlives the run.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from typing import Any

__all__ = ["FlagBlock", "SHM_DIR"]

NAME = "P2pIpcAFDConnector"
SHM_DIR = "/dev/shm"


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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)  # zero-filled: every flag EMPTY
            return cls(name, fd, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, name: str) -> FlagBlock:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise RuntimeError(
                f"{NAME}: the FFN's flag page {path} is not visible here; expected both roles to share one "
                "/dev/shm (one host and container, or containers started with --ipc=host). Use "
                "P2pNcclAFDConnector across hosts"
            ) from exc
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
