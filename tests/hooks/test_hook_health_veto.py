"""The health veto (patch ``health-add-health-veto``): its contract on the pinned tree (AST, no vLLM) and its
behaviour on the patched vLLM of this interpreter (the ``/health`` handler called directly).

A veto's exception becomes the handler's answer, with the same OpenAI-style body a request veto's exception
gets from the serving layer (one outage, one answer); without a veto the engine check answers, as upstream.
Every behaviour test unregisters what it registered: the registry is process-global.
"""

from __future__ import annotations

import ast
import asyncio
import json
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest
from hook_ast import find_def, param_names, parse, returned_name

HEALTH = "vllm/entrypoints/serve/instrumentator/health.py"
NOTICE = "AFD attention server unavailable: re-forming (hook test)"


@pytest.mark.wheel
def test_register_health_veto_takes_one_callable_and_returns_an_unregister_function(pinned_tree: Path) -> None:
    func = find_def(parse(pinned_tree, HEALTH), "register_health_veto")

    assert len(param_names(func)) == 1
    assert ast.unparse(func.args.args[0].annotation) == "HealthVeto"
    assert ast.unparse(func.returns) == "Callable[[], None]"
    assert returned_name(func) == "unregister"
    assert ast.get_docstring(func)


@pytest.mark.wheel
def test_health_vetoes_run_first_in_the_health_handler(pinned_tree: Path) -> None:
    handler = find_def(parse(pinned_tree, HEALTH), "health")

    first = handler.body[1]  # after the docstring

    assert isinstance(first, ast.For)
    assert ast.unparse(first.iter) == "_health_vetoes"
    assert "create_error_response(failure)" in ast.unparse(first)


@pytest.fixture
def health_module():
    """The patched handler module, with vetoes other tests' process-wide setup left hidden meanwhile."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter")
    try:
        from vllm.entrypoints.serve.instrumentator import health
        health.register_health_veto  # noqa: B018 - the seam's presence
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"this interpreter's vLLM lacks the patch series ({exc})")
    saved = list(health._health_vetoes)  # noqa: SLF001 - the registry's own list, restored below
    health._health_vetoes.clear()  # noqa: SLF001
    yield health
    health._health_vetoes[:] = saved  # noqa: SLF001


class LiveEngine:
    """An engine client whose liveness check passes (the engine core runs)."""

    def __init__(self) -> None:
        self.checks = 0

    async def check_health(self) -> None:
        self.checks += 1


def ask(health, engine: LiveEngine) -> tuple[int, dict]:
    raw_request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(engine_client=engine)))
    response = asyncio.run(health.health(raw_request))
    return response.status_code, json.loads(response.body) if response.body else {}


def outage():
    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError(NOTICE, HTTPStatus.SERVICE_UNAVAILABLE)


@pytest.mark.vllm
def test_without_a_veto_the_engine_check_answers(health_module) -> None:
    engine = LiveEngine()

    with_none = health_module.register_health_veto(lambda: None)
    try:
        assert ask(health_module, engine) == (200, {})
    finally:
        with_none()
    assert ask(health_module, engine) == (200, {})
    assert engine.checks == 2


@pytest.mark.vllm
def test_the_first_vetos_exception_is_the_answer_with_the_request_vetos_body(health_module) -> None:
    from vllm.entrypoints.serve.engine.serving import BaseServing

    engine = LiveEngine()
    unregister = [health_module.register_health_veto(veto) for veto in
                  (lambda: None, outage, lambda: RuntimeError("never reached"))]
    try:
        status, body = ask(health_module, engine)
    finally:
        for undo in unregister:
            undo()

    request_answer = BaseServing.create_error_response(outage())  # what a vetoed generation request reads
    assert status == 503
    assert body == json.loads(json.dumps(request_answer.model_dump()))
    assert body["error"]["message"] == NOTICE
    assert engine.checks == 0  # the veto answered before the engine was asked


@pytest.mark.vllm
def test_an_unregistered_veto_no_longer_answers(health_module) -> None:
    unregister = health_module.register_health_veto(outage)
    unregister()
    unregister()  # a second call is a no-op

    assert ask(health_module, LiveEngine())[0] == 200
