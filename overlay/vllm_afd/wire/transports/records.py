"""The IPC transport's records in the rendezvous store, and the checks every value passes before use.

Any client of the store can write any key (docs/connection.md#store-values), so nothing read from it is
trusted: a record is a small JSON object (never pickle) of bounded size, parsed here into checked
values. A value of the wrong type, out of its bounds, or other than the one this rank agreed to is
``AFDProtocolError`` naming the key, the value and what was expected, raised before any memory is
allocated, mapped or written from it, and before any file is opened.

Keys under ``afd/ipc/<data subgroup>/`` (``ipc.py``), and the control pair's (``mailbox.py``):

    who/<AFD rank>     {"problem": reason} when the rank cannot run the transport; else host, pid,
                       gpu, max_rows, num_stages, row_bytes and "problem": null
    access/<AFD rank>  null, or why the rank cannot write into its peer's GPU memory
    mem/<AFD rank>     its slot allocation: "handle" (CUDA IPC, hex), "bytes" (its size) and "flags",
                       the flag page's name on the FFN (group rank 0), null elsewhere
    ready/<AFD rank>   "1" (only waited for)
    afd/mailbox/<k>    the control pair's page: "name", "host", "slots", "slot_bytes"
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.transports.cuda_driver import IPC_HANDLE_BYTES
from vllm_afd.wire.transports.shm import check_shm_name

__all__ = ["MAX_RECORD_BYTES", "MAX_ROWS", "check_members", "exchange_access", "exchange_mem", "exchange_who",
           "gather", "parse_access", "parse_mailbox", "parse_mem", "parse_who", "ranks_sharing_gpu"]

NAME = "P2pIpcAFDConnector"
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes
MAX_ROWS = 1 << 20  # rows of one attention rank's largest step (max_num_batched_tokens): far above any real one
MAX_TEXT = 1024  # characters of a host name, GPU UUID or refusal reason
MAX_PID = (1 << 31) - 1
HANDLE = re.compile(f"[0-9a-f]{{{2 * IPC_HANDLE_BYTES}}}")
WHO_FIELDS = ("gpu", "host", "max_rows", "num_stages", "pid", "problem", "row_bytes")
MEM_FIELDS = ("bytes", "flags", "handle")
MAILBOX_FIELDS = ("host", "name", "slot_bytes", "slots")
FIX = ("Run the same vllm_afd version on every rank, and keep the rendezvous port private to the deployment "
       "(docs/connection.md#store-values)")


def record_error(key: str, what: str, value: Any, expected: str) -> AFDProtocolError:
    return AFDProtocolError(f"{NAME}: store record {key}: {what} is {value!r:.120}; expected {expected}. {FIX}")


def load_record(raw: Any, key: str) -> Any:
    """The JSON value of ``raw`` (bytes as read from the store), at most MAX_RECORD_BYTES long."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_RECORD_BYTES:
        size = len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__
        raise record_error(key, "the value", size, f"JSON of at most {MAX_RECORD_BYTES} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested without end
        raise record_error(key, "the value", bytes(raw[:80]), f"JSON ({exc})") from exc


def as_object(record: Any, key: str, fields: Sequence[str]) -> dict[str, Any]:
    """``record`` if it is a JSON object with exactly ``fields``."""
    if not isinstance(record, dict):
        raise record_error(key, "the value", record, "a JSON object")
    if sorted(record) != sorted(fields):
        raise record_error(key, "its set of fields", sorted(record), f"exactly {sorted(fields)}")
    return record


def int_in(record: Mapping[str, Any], key: str, field: str, low: int, high: int) -> int:
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise record_error(key, field, value, f"an int in {low}..{high}")
    return value


def text(value: Any, key: str, field: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise record_error(key, field, value, f"a string of 1..{MAX_TEXT} characters")
    return value


def parse_who(raw: Any, key: str, *, row_bytes: Mapping[str, Sequence[int]], num_stages: int) -> dict[str, Any]:
    """A member's ``who`` record: its identity, its ``max_rows``, and the sizes this rank agreed to."""
    record = load_record(raw, key)
    if isinstance(record, dict) and sorted(record) == ["problem"]:
        return {"problem": text(record["problem"], key, "problem")}
    record = as_object(record, key, WHO_FIELDS)
    if record["problem"] is not None:
        raise record_error(key, "problem", record["problem"], "null in a record that has the other fields")
    if isinstance(record["num_stages"], bool) or record["num_stages"] != num_stages:
        raise record_error(key, "num_stages", record["num_stages"],
                           f"{num_stages}, the handshake's num_stages (additional_config['afd']['num_stages'])")
    widths = {channel: list(sizes) for channel, sizes in sorted(row_bytes.items())}
    got = record["row_bytes"]
    exact = isinstance(got, dict) and all(isinstance(v, list) and all(type(n) is int for n in v) for v in got.values())
    if not exact or got != widths:
        raise record_error(key, "row_bytes (bytes per row of each message)", got,
                           f"{widths}, this rank's: the same model and gate placement on both roles")
    return {"host": text(record["host"], key, "host"), "pid": int_in(record, key, "pid", 1, MAX_PID),
            "gpu": text(record["gpu"], key, "gpu"), "max_rows": int_in(record, key, "max_rows", 1, MAX_ROWS),
            "num_stages": num_stages, "problem": None, "row_bytes": widths}


def parse_access(raw: Any, key: str) -> str | None:
    """A member's verdict on writing into its peers' GPU memory: None, or why it cannot."""
    verdict = load_record(raw, key)
    return None if verdict is None else text(verdict, key, "the verdict")


def parse_mem(raw: Any, key: str, *, nbytes: int, has_flags: bool) -> dict[str, Any]:
    """A member's ``mem`` record: its allocation's IPC handle, of the ``nbytes`` this rank's plan gives it."""
    record = as_object(load_record(raw, key), key, MEM_FIELDS)
    handle = record["handle"]
    if not isinstance(handle, str) or HANDLE.fullmatch(handle) is None:
        raise record_error(key, "handle", handle, f"{IPC_HANDLE_BYTES} bytes as {2 * IPC_HANDLE_BYTES} lowercase hex "
                                                  "digits (cuIpcGetMemHandle)")
    if isinstance(record["bytes"], bool) or record["bytes"] != nbytes:
        raise record_error(key, "bytes (its slot allocation)", record["bytes"],
                           f"{nbytes}, the size this rank's slot plan gives it: the members disagree on the plan")
    flags = record["flags"]
    if has_flags:
        flags = check_shm_name(flags, f"store record {key}")
    elif flags is not None:
        raise record_error(key, "flags", flags, "null: only the FFN (group rank 0) creates the flag page")
    return {"handle": bytes.fromhex(handle), "bytes": nbytes, "flags": flags}


def parse_mailbox(raw: Any, key: str) -> dict[str, Any]:
    """The FFN's control mailbox record: its page's name, its host and its geometry."""
    record = as_object(load_record(raw, key), key, MAILBOX_FIELDS)
    return {"name": check_shm_name(record["name"], f"store record {key}"), "host": text(record["host"], key, "host"),
            "slots": int_in(record, key, "slots", 1, 1 << 16),
            "slot_bytes": int_in(record, key, "slot_bytes", 1, 1 << 24)}


def gather(store: Any, prefix: str, kind: str, members: Sequence[int], deadline: float) -> dict[int, tuple[str, Any]]:
    """Every member's ``kind`` key of this subgroup and its raw value, in ``members`` order, waiting until
    ``deadline``."""
    keys = {rank: f"{prefix}/{kind}/{rank}" for rank in members}
    timeout = max(deadline - time.monotonic(), 0.01)
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's store timeouts are RuntimeErrors (DistStoreError)
        missing = [rank for rank, key in keys.items() if not store.check([key])]
        raise RuntimeError(
            f"{NAME}: AFD ranks {missing} did not publish their IPC '{kind}' record within {timeout:.0f}s; expected "
            f"every rank of the data subgroup to open {NAME}. Configure both roles with it and check their logs"
        ) from exc
    return {rank: (key, store.get(key)) for rank, key in keys.items()}


def exchange_who(store: Any, prefix: str, own: int, record: dict[str, Any], members: Sequence[int],
                 deadline: float) -> dict[int, dict[str, Any]]:
    """Publish this rank's ``who`` record; every member's, parsed against this rank's sizes.

    This rank's own record must come back as published: one that differs was written by another client.
    """
    store.set(f"{prefix}/who/{own}", json.dumps(record))
    widths, stages = record["row_bytes"], record["num_stages"]
    records = {rank: parse_who(raw, key, row_bytes=widths, num_stages=stages)
               for rank, (key, raw) in gather(store, prefix, "who", members, deadline).items()}
    if records[own] != record:
        raise record_error(f"{prefix}/who/{own}", "this rank's own record", records[own], f"{record}, as published")
    return records


def exchange_access(store: Any, prefix: str, own: int, verdict: str | None, members: Sequence[int],
                    deadline: float) -> str | None:
    """Publish this rank's verdict on peer access; the first refusal of any member, or None."""
    store.set(f"{prefix}/access/{own}", json.dumps(verdict))
    if verdict is not None:
        return verdict
    verdicts = (parse_access(raw, key) for key, raw in gather(store, prefix, "access", members, deadline).values())
    return next(filter(None, verdicts), None)


def exchange_mem(store: Any, prefix: str, own: int, mine: dict[str, Any], members: Sequence[int],
                 sizes: Sequence[int], deadline: float) -> dict[int, dict[str, Any]]:
    """Publish this rank's ``mem`` record; every member's, checked against ``sizes`` (bytes by group rank)."""
    store.set(f"{prefix}/mem/{own}", json.dumps(mine))
    raw_records = gather(store, prefix, "mem", members, deadline).values()
    return {rank: parse_mem(raw, key, nbytes=sizes[group], has_flags=group == 0)
            for group, (rank, (key, raw)) in enumerate(zip(members, raw_records))}


def check_members(records: Mapping[int, Mapping[str, Any]], own: int) -> None:
    """Refuse, with the fix, a data subgroup the transport cannot serve (parsed records by AFD rank)."""
    for rank, record in sorted(records.items()):
        if record["problem"] is not None:
            raise RuntimeError(
                f"{NAME}: AFD rank {rank} cannot use CUDA stream memory operations ({record['problem']}); expected "
                "a CUDA 11.7+ driver on a GPU that maps host memory. Use P2pNcclAFDConnector (one GPU per rank) "
                "or P2pGlooAFDConnector (eager)"
            )
    mine = records[own]
    for rank, record in sorted(records.items()):
        if record["host"] != mine["host"]:
            raise RuntimeError(
                f"{NAME} needs every rank of a data subgroup on one host (AFD rank {own} on {mine['host']!r}, AFD "
                f"rank {rank} on {record['host']!r}); CUDA IPC does not cross hosts. Use P2pNcclAFDConnector"
            )
        if rank != own and record["pid"] == mine["pid"]:
            raise RuntimeError(
                f"{NAME}: AFD ranks {own} and {rank} are one process (pid {mine['pid']}); CUDA IPC maps memory of "
                "another process. Run each role in its own process"
            )


def ranks_sharing_gpu(records: Mapping[int, Mapping[str, Any]], own: int) -> list[int]:
    """The other AFD ranks of the subgroup on this rank's GPU (parsed records by AFD rank)."""
    return sorted(rank for rank, record in records.items() if rank != own and record["gpu"] == records[own]["gpu"])
