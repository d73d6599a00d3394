"""Link models: one message costs latency + bytes / bandwidth (docs/planner.md#links, where the numbers come from)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LINKS", "Link", "parse_link"]


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    gb_per_s: float  # one direction, 1e9 bytes/s
    latency_us: float  # per message

    def one_way_ms(self, num_bytes: float) -> float:
        """One message of `num_bytes`."""
        return self.latency_us / 1e3 + num_bytes / (self.gb_per_s * 1e9) * 1e3

    def round_trip_ms(self, num_bytes: float) -> float:
        """`num_bytes` out and the same back (one AFD exchange's wire time)."""
        return 2 * self.one_way_ms(num_bytes)


# Per direction, from the public spec sheets; latencies are small-message figures of NCCL-class transports.
LINKS = {
    # NVIDIA H200 SXM: NVLink 900 GB/s is both directions together -> 450 GB/s each way.
    "nvlink": Link("nvlink", 450.0, 3.0),
    # PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b -> ~63 GB/s each way.
    "pcie": Link("pcie", 64.0, 5.0),
    # InfiniBand NDR: 400 Gb/s per port -> 50 GB/s each way (GPUDirect RDMA).
    "ib": Link("ib", 50.0, 5.0),
    # 100 Gigabit Ethernet: 12.5 GB/s line rate, ~12 after framing; RoCE latency (TCP is 2-5x more).
    "eth": Link("eth", 12.0, 10.0),
}


def parse_link(text: str, flag: str = "--link") -> Link:
    """A named link (`nvlink`, `pcie`, `ib`, `eth`) or `GB_PER_S,LATENCY_US` (e.g. `25,8`); errors name `flag`."""
    if text in LINKS:
        return LINKS[text]
    parts = text.split(",")
    try:
        gb_per_s, latency_us = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected one of {sorted(LINKS)} or 'GB_PER_S,LATENCY_US' "
                         "(e.g. '25,8': 25 GB/s each way, 8 us per message)") from None
    if not (math.isfinite(gb_per_s) and gb_per_s > 0 and math.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"{flag} {text!r}: bandwidth must be > 0 GB/s and latency >= 0 us, both finite")
    return Link(f"{gb_per_s:g} GB/s, {latency_us:g} us", gb_per_s, latency_us)
