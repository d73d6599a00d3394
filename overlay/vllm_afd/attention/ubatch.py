"""The CPU attention's micro-batch stages: one thread per stage, one baton (docs/pingpong.md#42-v1-cpu-runner).

vLLM's V1 micro-batch executor cannot run on CPU (`UBatchWrapper` makes a CUDA stream and
`UBatchContext` sets CUDA streams), so the CPU runner drives its stages here: `run_stages` runs
the native model forward once per stage, each on its own thread with its own forward context, and
`CPUStageBaton` lets exactly one of them run at a time, handed round-robin (stage 0, 1, …, k-1, 0,
…) at every `yield_stage()` — which the AFD send op calls right after issuing a send — and when a
stage finishes. This is `UBatchContext`'s CPU handoff (`_cpu_yield`) without streams: the
attention then issues its exchanges in (layer, stage) order, the order that cannot deadlock
(docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock).

vLLM's current forward context is one module global: a resumed stage makes its own context
current again through vLLM's `override_forward_context` (its exit restores the context entered,
which is the stage's own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from vllm.forward_context import get_forward_context, override_forward_context

from vllm_afd.compute_threads import prepare_compute_thread

__all__ = ["CPUStageBaton", "run_stages"]

T = TypeVar("T")


class CPUStageBaton:
    """k stage threads take turns; see the module docstring. Waits are bounded by ``timeout_s``."""

    def __init__(self, num_stages: int, timeout_s: float) -> None:
        if num_stages < 1:
            raise ValueError(f"AFD stages: a baton needs >= 1 stage, got {num_stages}")
        self.num_stages = num_stages
        self.timeout_s = timeout_s
        self._turn = [threading.Event() for _ in range(num_stages)]
        self._finished = [False] * num_stages
        self._lock = threading.Lock()
        self._local = threading.local()

    def current_stage(self) -> int | None:
        """The stage the calling thread runs, or None outside the stage threads."""
        return getattr(self._local, "stage", None)

    def yield_stage(self) -> None:
        """Hand the baton to the next unfinished stage and wait for it to come back (no-op for one stage)."""
        stage = self.current_stage()
        if stage is None:
            raise RuntimeError("AFD stages: yield_stage() outside a stage thread; expected it from an AFD op "
                               "running in run_stages")
        if not self._pass_from(stage):
            return  # every other stage has finished: keep running
        mine = get_forward_context()
        with override_forward_context(mine):  # NOTE: its exit makes this stage's context current again
            self._wait_turn(stage)

    def _pass_from(self, stage: int) -> bool:
        """Wake the next unfinished stage after ``stage``; False when there is none."""
        with self._lock:
            for step in range(1, self.num_stages):
                other = (stage + step) % self.num_stages
                if not self._finished[other]:
                    self._turn[other].set()
                    return True
        return False

    def _wait_turn(self, stage: int) -> None:
        if not self._turn[stage].wait(self.timeout_s):
            raise RuntimeError(
                f"AFD stages: stage {stage} waited {self.timeout_s:g}s for its turn; another stage neither yielded "
                "nor finished. Its AFD transfer should have failed first (step_timeout_s): check the log"
            )
        self._turn[stage].clear()

    def _finish(self, stage: int) -> None:
        with self._lock:
            self._finished[stage] = True
        self._pass_from(stage)

    def run(self, bodies: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``bodies[j]`` as stage j, one at a time in baton order; their results, or the first error."""
        if len(bodies) != self.num_stages:
            raise ValueError(f"AFD stages: {len(bodies)} stage bodies for a baton of {self.num_stages} stages")
        results: list[Any] = [None] * self.num_stages
        errors: list[BaseException] = []

        def stage_main(stage: int) -> None:
            self._local.stage = stage
            prepare_compute_thread()
            try:
                self._wait_turn(stage)
                results[stage] = bodies[stage]()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)
            finally:
                self._finish(stage)

        threads = [threading.Thread(target=stage_main, args=(j,), name=f"afd-stage-{j}", daemon=True)
                   for j in range(self.num_stages)]
        for thread in threads:
            thread.start()
        self._turn[0].set()
        for thread in threads:
            thread.join()  # bounded: every wait in a stage is (the baton's, the connector's watchdog)
        if errors:
            raise errors[0]
        return results


def run_stages(forward: Callable[[int], T], contexts: Sequence[Any], baton: CPUStageBaton) -> list[T]:
    """``forward(j)`` for every stage j on its own thread, inside ``contexts[j]`` and inference mode."""
    outer = get_forward_context()

    def body(stage: int) -> Callable[[], T]:
        def run() -> T:
            with torch.inference_mode(), override_forward_context(contexts[stage]):
                return forward(stage)
        return run

    with override_forward_context(outer):  # NOTE: the stages' exits leave the global wherever: restore it
        return baton.run([body(j) for j in range(len(contexts))])
