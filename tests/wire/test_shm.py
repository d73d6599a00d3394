"""vllm_afd.wire.transports.shm: a page named through the store is opened only if it is one the FFN made.

The name comes from the rendezvous store, which any client can write (docs/connection.md#store-values):
a name outside the creator's pattern is refused before anything is opened, a symbolic link is not
followed, and a file of another size is not mapped.
"""

from __future__ import annotations

import os
import secrets

import pytest

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.transports.shm import SHM_DIR, SHM_NAME, FlagBlock, check_shm_name, page_bytes


@pytest.fixture
def shm_path():
    """A free name of the creator's pattern in /dev/shm, removed afterwards whatever the test left there."""
    name = f"afd-ipc-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    yield name, path
    if os.path.lexists(path):
        os.unlink(path)


def test_the_creator_names_its_pages_by_the_pattern_it_accepts_and_both_ends_share_the_flags():
    page = FlagBlock.create(100)
    try:
        peer = FlagBlock.attach(page.name, 100)
        page.write(3, 7)

        assert SHM_NAME.fullmatch(page.name) and check_shm_name(page.name, "test") == page.name
        assert peer.read(3) == 7 and peer.nbytes == page.nbytes == page_bytes(100)
        peer.close()
    finally:
        page.unlink()
        page.close()


def test_a_symbolic_link_in_place_of_the_page_is_not_followed(shm_path, tmp_path):
    name, path = shm_path
    target = tmp_path / "victim"
    target.write_bytes(bytes(page_bytes(64)))
    os.symlink(target, path)

    with pytest.raises(AFDProtocolError, match=f"cannot open the shared-memory page {path} .*; expected a regular "
                                               "file the FFN created"):
        FlagBlock.attach(name, 64)

    assert target.read_bytes() == bytes(page_bytes(64))


@pytest.mark.parametrize("size", [0, 1, 2 * page_bytes(64)])
def test_a_file_of_another_size_than_the_ffns_page_is_not_mapped(shm_path, size):
    name, path = shm_path
    with open(path, "wb") as file:
        file.write(bytes(size))

    with pytest.raises(AFDProtocolError, match=f"is a regular file of {size} bytes; expected the FFN's page of "
                                               f"{page_bytes(64)} bytes"):
        FlagBlock.attach(name, 64)


def test_a_directory_in_place_of_the_page_is_refused(shm_path):
    name, path = shm_path
    os.mkdir(path)
    try:
        with pytest.raises(AFDProtocolError, match="cannot open the shared-memory page"):
            FlagBlock.attach(name, 64)
    finally:
        os.rmdir(path)


def test_a_missing_page_names_the_shared_dev_shm_fix(shm_path):
    name, _ = shm_path

    with pytest.raises(RuntimeError, match="is not visible here; expected both roles to share one /dev/shm"):
        FlagBlock.attach(name, 64)
