"""Start an AFD deployment (one FFN server, one attention server) for tests, demo and benchmarks.

Both roles are plain `vllm serve` processes with the same `--additional-config
'{"afd": {...}}'` except for `role`; they may start in either order, since each waits for
the other only in its rendezvous.  On a 2-core machine each role gets its own core (its worker's
OpenMP threads; `pin_processes` pins every process of the role there).

    with AFDDeployment(model_dir, python=py) as afd:
        complete(afd.attention.base_url, "Hello", max_tokens=8)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from afd_harness.server import VllmServer, cpu_server_env, free_ports

DEFAULT_CONNECTOR = "P2pGlooAFDConnector"


def pinned_cpus(omp_cpus: str) -> str:
    """The `taskset -c` list of a role's processes: every core its ranks' OpenMP binds name ("1|1" -> "1")."""
    return ",".join(dict.fromkeys(omp_cpus.split("|")))


def afd_args(role: str, port: int, **afd_fields: Any) -> list[str]:
    """`--additional-config` for one role; `afd_fields` add or override AFD keys."""
    afd = {"role": role, "connector": DEFAULT_CONNECTOR, "port": port, **afd_fields}
    return ["--additional-config", json.dumps({"afd": afd})]


class AFDDeployment:
    """An FFN server and an attention server on loopback; a context manager."""

    def __init__(
        self,
        model: str | Path,
        *,
        python: str,
        log_dir: Path,
        ffn_model: str | Path | None = None,
        attention_first: bool = False,
        afd_fields: Mapping[str, Any] | None = None,
        attention_args: Sequence[str] = (),
        ffn_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        attention_cpus: str = "1",
        ffn_cpus: str = "0",
        pin_processes: bool = False,
        startup_timeout_s: float = 600.0,
    ):
        # NOTE: three ports bound at once, so the rendezvous port and the two HTTP ports
        # can never be handed out twice.
        self.afd_port, ffn_http_port, attention_http_port = free_ports(3)
        self.attention_first = attention_first
        self.model, self.log_dir = Path(model), Path(log_dir)
        fields = dict(afd_fields or {})
        common = dict(python=python, launcher="cli", startup_timeout_s=startup_timeout_s)
        # NOTE: VLLM_CPU_OMP_THREADS_BIND binds only the worker's OpenMP threads; the API server and the engine
        # core (whose shm queue spins with sched_yield while a step runs) float over both cores unless pinned.
        # With several ranks per role ("1|1": one OpenMP bind per DP rank) every process goes on their cores' union.
        ffn_prefix = ("taskset", "-c", pinned_cpus(ffn_cpus)) if pin_processes else ()
        attention_prefix = ("taskset", "-c", pinned_cpus(attention_cpus)) if pin_processes else ()
        self.ffn = VllmServer(
            ffn_model or model, **common, port=ffn_http_port, log_path=Path(log_dir) / "ffn.log",
            command_prefix=ffn_prefix,
            extra_args=[*afd_args("ffn", self.afd_port, **fields), *ffn_args],
            env={**cpu_server_env(omp_cpus=ffn_cpus), **(env or {})},
        )
        self.attention = VllmServer(
            model, **common, port=attention_http_port,
            log_path=Path(log_dir) / "attention.log", command_prefix=attention_prefix,
            extra_args=[*afd_args("attention", self.afd_port, **fields), *attention_args],
            env={**cpu_server_env(omp_cpus=attention_cpus), **(env or {})},
        )

    @property
    def servers(self) -> tuple[VllmServer, VllmServer]:
        """In start order."""
        if self.attention_first:
            return self.attention, self.ffn
        return self.ffn, self.attention

    def start(self) -> None:
        try:
            for server in self.servers:
                server.spawn()
            for server in self.servers:
                server.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        # Attention first: a lost FFN is an error the attention reports, not the goal here.
        for server in (self.attention, self.ffn):
            if server.process is not None:
                server.stop()

    def __enter__(self) -> AFDDeployment:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
