"""Where a rank's step records go: the timeline file and the AFD metrics (docs/timeline.md, docs/metrics.md).

The connector stamps its timeline (wire/timeline.py); the role's runner calls ``after_step`` once per
executed step, which drains the completed records into ``<timeline_dir>/<role>-<rank>.jsonl`` (one
JSON object per step, when ``timeline_dir`` is set) and into the metrics. Nothing here waits for the
device: a record whose device stamps are not written yet is taken at a later step.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from vllm_afd.config import AFDConfig
from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.placement import Placement

__all__ = ["Telemetry", "timeline_path"]


def timeline_path(afd_config: AFDConfig, placement: Placement) -> str:
    return os.path.join(afd_config.timeline_dir, f"{placement.role}-{placement.role_rank}.jsonl")


class Telemetry:
    """One rank's consumer of its connector's step records."""

    def __init__(self, afd_config: AFDConfig, placement: Placement, connector: AFDConnector) -> None:
        self.connector = connector
        self._file: IO[str] | None = None
        self.path: str | None = None
        if afd_config.timeline_dir:
            self.path = timeline_path(afd_config, placement)
            try:
                os.makedirs(afd_config.timeline_dir, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8", buffering=1)
            except OSError as exc:
                raise ValueError(
                    f"AFD timeline_dir {afd_config.timeline_dir!r}: cannot append to {self.path} on "
                    f"{placement.label} ({exc}); pass a writable directory, or leave timeline_dir out"
                ) from exc
        self.metrics: Any = _make_metrics(afd_config, placement, connector)

    def after_step(self) -> None:
        """Drain the records completed so far into the file and the metrics."""
        records = self.connector.take_records()
        if self._file is not None:
            for record in records:
                self._file.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
        if self.metrics is not None:
            self.metrics.observe_steps(records)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        file, self._file = self._file, None
        if file is not None:
            file.close()


def _make_metrics(afd_config: AFDConfig, placement: Placement, connector: AFDConnector) -> Any:
    from vllm_afd.metrics import make_rank_metrics

    return make_rank_metrics(placement.role, placement.role_rank, afd_config.connector, connector)
