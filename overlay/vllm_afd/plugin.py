"""The `vllm.general_plugins` entry point: registration only, inert unless AFD is asked for.

vLLM calls `register()` in every process it starts (front end, engine core, workers, the
model-inspection subprocess), so it must be cheap, idempotent and free of CUDA work.  It
registers three things through official seams:

* the AFD model aliases (`ModelRegistry.register_model` with lazy "module:Class" strings);
* a vLLM config hook (patch `config-add-vllm-config-hooks`).  The hook does nothing unless
  `additional_config["afd"]` is present; then it validates the AFD config, picks the
  role's worker class while `worker_cls` is still "auto", applies the role defaults
  (the FFN's front-end request veto; the attention server's keep-alive on engine death,
  its 503 for requests and /health while the engine is down or heals after an AFD failure,
  outage.py, and vLLM's fault tolerance where it can heal a lost FFN, attention/healing.py)
  and, in the root process, exposes the workers' AFD metrics on /metrics (metrics.py);
* an engine-core fault responder (patch `engine-core-sentinel-add-fault-responders`) that
  answers an AFD failure with an immediate retry; inert for any other fault and without AFD.

Forward-context hooks are never registered here: the attention runner registers its own
in `__init__` and removes it in `shutdown`, so FFN and non-AFD processes never see one.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

from vllm_afd.config import parse_afd_config
from vllm_afd.role import Role

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

    from vllm_afd.config import AFDConfig

_registered = False

FFN_VETO_MESSAGE = (
    "This vLLM server runs the AFD FFN role (additional_config.afd.role='ffn') and "
    "serves no requests; send requests to the AFD attention server (the vllm serve "
    "started with role 'attention')."
)


def register() -> None:
    """Entry point: check the installed vLLM is the patched build, then register."""
    global _registered
    if _registered:
        return
    from vllm_afd.pin import check_installed_vllm

    check_installed_vllm()  # before touching any hook: a clear error on an unpatched vLLM
    from vllm.config.vllm import register_vllm_config_hook
    from vllm.v1.fault_tolerance.engine_core_sentinel import register_fault_responder

    from vllm_afd.models import register_afd_models

    register_afd_models()
    register_vllm_config_hook(apply_afd_config)
    register_fault_responder(retry_after_afd_outage)
    route_afd_logs_to_vllm()
    _registered = True


def route_afd_logs_to_vllm() -> None:
    """Send the overlay's log lines (logger ``vllm_afd``) through vLLM's own handlers.

    vLLM configures only its ``vllm`` logger namespace, so without this every AFD line below
    WARNING (FFN graph captures, the FFN loop's state) never reached a server's log, and warnings
    lost vLLM's format.  Only our own logger is configured; where vLLM's logging is off or
    replaced (``VLLM_CONFIGURE_LOGGING=0``, a config file without handlers on ``vllm``), ours is
    left to the root logger as before.
    """
    import logging

    ours, theirs = logging.getLogger("vllm_afd"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def current_platform_name() -> str:
    """"cuda" or "cpu" for the running vLLM platform; anything else by its device type."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return current_platform.device_type


def apply_afd_config(vllm_config: VllmConfig) -> None:
    """vLLM config hook: called by `VllmConfig.__post_init__` before platform defaults.

    A config hook receives the config under construction to update it, as a platform's
    `check_and_update_config` does; it may run again on revalidation, so it is idempotent.
    """
    afd = parse_afd_config(vllm_config)
    if afd is None:
        return
    from vllm_afd.metrics import expose_worker_metrics
    from vllm_afd.validation import check_worker_stack, worker_class_for

    # NOTE: before the engine core starts: its processes inherit the metrics directory (docs/metrics.md).
    expose_worker_metrics()

    parallel = vllm_config.parallel_config
    platform = current_platform_name()
    if platform == "cpu" and afd.role == Role.ATTENTION:
        from vllm_afd.releases import check_cpu_attention, installed

        check_cpu_attention(installed())  # before vLLM's own platform checks (0.34: no V1 CPU runner)
    if parallel.worker_cls == "auto":
        parallel.worker_cls = worker_class_for(platform, afd.role)
    else:
        check_worker_stack(parallel.worker_cls, platform, afd.role)
    if afd.role == Role.FFN:
        # NOTE: the FFN reports no KV cache; vLLM's scheduler tolerates a KV-less
        # config only without prefix caching (as for attention-free models).
        vllm_config.cache_config.enable_prefix_caching = False
        _install_ffn_request_veto()
    else:
        # NOTE: vLLM keeps the API server up after engine death only with this flag;
        # an attention server must keep answering /health (503) when the FFN is lost.
        os.environ.setdefault("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")
        _install_attention_outage_veto()
        enable_attention_healing(vllm_config, afd)


def enable_attention_healing(vllm_config: VllmConfig, afd: AFDConfig) -> None:
    """Turn on vLLM's fault tolerance for an attention that can heal a lost FFN (attention/healing.py),
    else log once why it cannot: then a lost FFN stops its engine and the server must be restarted."""
    from vllm_afd.validation import healing_blocker

    blocker = healing_blocker(vllm_config, afd)
    parallel = vllm_config.parallel_config
    if blocker is None and not parallel.enable_fault_tolerance:
        parallel.enable_fault_tolerance = True
        # NOTE: AFD's fault responder retries an AFD failure at once; any other fault ends the engine
        # at once, as it did without fault tolerance, instead of waiting for an operator's retry.
        parallel.fault_tolerance_config.engine_recovery_timeout_sec = 0
    elif blocker is not None and not parallel.enable_fault_tolerance:
        from vllm.logger import init_logger

        init_logger(__name__).info_once(
            "AFD attention: a lost FFN will stop this server, which must then be restarted (%s)", blocker)


# NOTE: one recovery round, one request_id: vLLM 0.34 keys a round's rendezvous on it (the retry's
# recovery store, the workers' regrouping ports), so every retry needs a fresh one; a count, not a random
# id, so that engines answering the same outages would agree on it as vLLM asks (healing runs at DP 1).
_heal_rounds = itertools.count(1)


def retry_after_afd_outage(fault: Exception) -> FaultToleranceRequest | None:
    """Engine core fault responder (patch ``engine-core-sentinel-add-fault-responders``): retry at once
    when the fault is an AFD failure, which the workers heal by pairing again; else leave it to vLLM.

    An AFD failure writes the outage notice before it is raised (outage.py), so the notice tells it
    apart from any other fault even where the executor wrapped the worker's exception in a string.
    Each retry is a recovery round of its own: ``afd-heal-<n>``, n counting this engine's retries.
    """
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

    from vllm_afd.metrics import metrics_dir
    from vllm_afd.outage import read_outage

    directory = metrics_dir()
    if directory is None or read_outage(directory) is None:
        return None
    return FaultToleranceRequest(instruction="retry", params={}, request_id=f"afd-heal-{next(_heal_rounds)}")


_veto_installed = False


def _install_ffn_request_veto() -> None:
    """Make the FFN's generation endpoints answer HTTP 400 pointing to the attention."""
    global _veto_installed
    if _veto_installed:
        return
    from vllm.entrypoints.serve.engine.serving import register_request_veto

    register_request_veto(_veto_ffn_request)
    _veto_installed = True


def _veto_ffn_request(request: object) -> str:
    return FFN_VETO_MESSAGE


_outage_veto_installed = False


def _install_attention_outage_veto() -> None:
    """While the attention's engine is down or heals after an AFD failure, answer generation requests and
    ``/health`` with HTTP 503 naming the cause (outage.py); a server's root process first drops a notice an
    earlier run left behind."""
    global _outage_veto_installed
    if _outage_veto_installed:
        return
    import multiprocessing

    from vllm.entrypoints.serve.engine.serving import register_request_veto
    from vllm.entrypoints.serve.instrumentator.health import register_health_veto

    from vllm_afd.metrics import metrics_dir
    from vllm_afd.outage import clear_outage

    directory = metrics_dir()
    if directory is not None and multiprocessing.parent_process() is None:
        clear_outage(directory)
    register_request_veto(_veto_during_outage)
    register_health_veto(_outage_refusal)
    _outage_veto_installed = True


def _veto_during_outage(request: object) -> Exception | None:
    return _outage_refusal()


def _outage_refusal() -> Exception | None:
    """The 503 of an outage (the same answer for a request and for ``/health``), or None while serving."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    from vllm_afd.metrics import metrics_dir
    from vllm_afd.outage import read_outage

    directory = metrics_dir()
    notice = None if directory is None else read_outage(directory)
    return None if notice is None else GracefulHTTPError(notice, HTTPStatus.SERVICE_UNAVAILABLE)
