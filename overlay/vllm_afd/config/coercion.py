"""Validation step 4 (docs/config.md#coercion): each present field to its type, in one fixed order."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class FrozenMapping(Mapping):
    """Read-only, picklable, deep-copied mapping; the value of ``connector_extra_config``."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] = ()) -> None:
        self._data = copy.deepcopy(dict(data))

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    # NOTE: a tuple, because pickle skips __setstate__ for a false state such as an empty dict.
    def __getstate__(self) -> tuple[dict[Any, Any]]:
        return (self._data,)

    def __setstate__(self, state: tuple[dict[Any, Any]]) -> None:
        (self._data,) = state


# Every failure is a TypeError naming the field and the value.


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    shown = "async" if name == "async_dp" else name
    raise TypeError(
        f"{shown} must be a boolean, got {value!r}; use true/false (1/0, yes/no and on/off are "
        "accepted too)"
    )


def _coerce_int(name: str, value: Any) -> int:
    problem = isinstance(value, (bool, float))
    if not problem:
        try:
            result = int(value)
        except (TypeError, ValueError):
            problem = True
        else:
            # NOTE: int() truncates Decimal/Fraction silently; a non-whole number is a typo here.
            problem = isinstance(value, numbers.Number) and result != value
    if problem:
        raise TypeError(f"{name} must be an integer, got {value!r}; pass a whole number such as 1")
    return result


def _coerce_seconds(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise TypeError(
        f"{name} must be a number of seconds, got {value!r}; pass an int, a float or a numeric string"
    )


def _coerce_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {value!r}; quote the value in the JSON")
    return str(value)


def _coerce_host(name: str, value: Any) -> str:
    # NOTE: stripped because the emptiness rule (validation step 11) is "after strip" and a hostname with
    # surrounding blanks can only be a typo.
    return _coerce_str(name, value).strip()


def _coerce_mapping(name: str, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a mapping, got {type(value).__name__}; pass a JSON object or leave it out"
        )
    return FrozenMapping(value)


# Coercion order = report order of validation step 4 (docs/config.md#coercion: canonical order,
# independent of the input's order). Its keys are every input key: the fields plus ``async_dp``.
COERCERS: dict[str, Callable[[str, Any], Any]] = {
    "role": _coerce_str,
    "connector": _coerce_str,
    "host": _coerce_host,
    "port": _coerce_int,
    "num_attention_ranks": _coerce_int,
    "num_ffn_ranks": _coerce_int,
    "compute_gate_on_attention": _coerce_bool,
    "num_stages": _coerce_int,
    "min_tokens_per_stage": _coerce_int,
    "async_dp": _coerce_bool,
    "connector_extra_config": _coerce_mapping,
    "rendezvous_timeout_s": _coerce_seconds,
    "step_timeout_s": _coerce_seconds,
    "peer_timeout_s": _coerce_seconds,
    "startup_timeout_s": _coerce_seconds,
    "reform_timeout_s": _coerce_seconds,
    "timeline_dir": _coerce_str,
    "secret_file": _coerce_str,
    "integrity": _coerce_bool,
}
