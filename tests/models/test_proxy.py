"""The attention-side proxies drive the transport ops in order (docs/protocol.md#transport-ops-and-torchcompile, docs/models.md#attention-side-proxies).

Each check runs in a child process (op registrations are per process): one registers
recording stand-ins for `vllm_afd::afd_send` / `afd_recv`, the other the real ops with a
loopback connector of ours behind them; both report what the proxies did, eagerly and
under `torch.compile`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm")

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from torch.library import Library
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import direct_register_custom_op

    calls = []

    def afd_send(hidden_states: torch.Tensor, router_logits: torch.Tensor | None, layer_idx: int) -> None:
        calls.append({"op": "send", "layer": layer_idx, "rows": hidden_states.shape[0],
                      "hidden_sum": float(hidden_states.float().sum()),
                      "logits_sum": None if router_logits is None else float(router_logits.float().sum())})

    def afd_recv(out: torch.Tensor, layer_idx: int) -> None:
        calls.append({"op": "recv", "layer": layer_idx, "shape": list(out.shape), "dtype": str(out.dtype)})
        out.fill_(layer_idx + 0.5)

    lib = Library("vllm_afd", "FRAGMENT")
    direct_register_custom_op("afd_send", afd_send, mutates_args=["hidden_states"],
                              fake_impl=lambda hidden_states, router_logits, layer_idx: None,
                              target_lib=lib, dispatch_key="CPU")
    direct_register_custom_op("afd_recv", afd_recv, mutates_args=["out"],
                              fake_impl=lambda out, layer_idx: None, target_lib=lib, dispatch_key="CPU")

    from vllm_afd.models.proxy import RemoteFFNProxy
    from vllm_afd.models.qwen3_moe import AFDQwen3MoeProxy

    report = {}
    hidden = torch.randn(5, 128, dtype=torch.bfloat16)
    hidden_sum = float(hidden.float().sum())
    out = RemoteFFNProxy(3)(hidden)
    report["dense"] = {"calls": calls[:], "out": float(out.float().mean()), "dtype": str(out.dtype),
                       "hidden_sum": hidden_sum, "in_place": out.data_ptr() == hidden.data_ptr()}

    calls.clear()
    config = EngineArgs(model=sys.argv[1], enforce_eager=True, skip_tokenizer_init=True,
                        additional_config={"afd": {"role": "attention",
                                                   "connector": "P2pGlooAFDConnector"}}).create_engine_config()
    with set_current_vllm_config(config), torch.device("cpu"):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
        ensure_model_parallel_initialized(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        proxy = AFDQwen3MoeProxy(config, "model.layers.1.mlp", gate_on_attention=True)
        torch.nn.init.normal_(proxy.gate.weight)
        process_weights_after_loading(proxy, config.model_config, torch.device("cpu"))
    hidden = torch.randn(5, 128, dtype=torch.bfloat16)
    logits, _ = proxy.gate(hidden)
    out = proxy(hidden)
    report["moe"] = {"calls": calls[:], "logits_sum": float(logits.float().sum()), "out": float(out.float().mean())}

    calls.clear()
    compiled = torch.compile(RemoteFFNProxy(2), fullgraph=True, dynamic=True, backend="eager")
    outs = [float(compiled(torch.randn(n, 128, dtype=torch.bfloat16)).float().mean()) for n in (3, 9)]
    report["compiled"] = {"calls": calls[:], "outs": outs}
    print("REPORT " + json.dumps(report))
''')


def start_child(script: str, *args: str) -> subprocess.Popen:
    """Start `script` in a fresh interpreter without the AFD plugin."""
    others = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != "afd"]
    env = dict(os.environ, VLLM_PLUGINS=",".join(others))
    overlay = Path(__file__).resolve().parents[2] / "overlay"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def child_report(child: subprocess.Popen) -> dict:
    """The child's REPORT line, parsed; its stderr tail if it failed."""
    stdout, stderr = child.communicate(timeout=300)
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    assert child.returncode == 0 and lines, stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def children(tiny_model_dirs):
    """The module's three children, started together: each imports vLLM and one compiles with inductor,
    so side by side they take about half the time on CI's two cores."""
    from afd_harness.server import free_ports

    model = str(tiny_model_dirs["qwen3_moe"])
    proxies_port, whole_model_port = map(str, free_ports(2))
    started = {"proxies": start_child(CHILD, model, proxies_port), "loopback": start_child(LOOPBACK),
               "whole_model": start_child(WHOLE_MODEL, model, whole_model_port)}
    yield started
    for child in started.values():
        if child.poll() is None:
            child.kill()
            child.communicate()


@pytest.fixture(scope="module")
def report(children):
    return child_report(children["proxies"])


def test_dense_proxy_sends_hidden_then_receives_into_the_sent_tensor(report):
    dense = report["dense"]

    assert [call["op"] for call in dense["calls"]] == ["send", "recv"]
    send, recv = dense["calls"]
    assert (send["layer"], send["rows"], send["logits_sum"]) == (3, 5, None)
    assert send["hidden_sum"] == pytest.approx(dense["hidden_sum"])
    assert (recv["layer"], recv["shape"], recv["dtype"]) == (3, [5, 128], "torch.bfloat16")
    assert dense["out"] == 3.5 and dense["dtype"] == "torch.bfloat16" and dense["in_place"]


def test_moe_proxy_with_the_gate_on_attention_sends_its_router_logits(report):
    moe = report["moe"]

    assert [call["op"] for call in moe["calls"]] == ["send", "recv"]
    assert moe["calls"][0]["layer"] == 1
    assert moe["calls"][0]["logits_sum"] == pytest.approx(moe["logits_sum"], rel=1e-3)
    assert moe["out"] == 1.5


def test_compiled_proxy_calls_the_ops_on_every_forward(report):
    compiled = report["compiled"]

    assert [(call["op"], call["layer"]) for call in compiled["calls"]] == [
        ("send", 2), ("recv", 2), ("send", 2), ("recv", 2)]
    assert [call["rows"] for call in compiled["calls"] if call["op"] == "send"] == [3, 9]
    assert compiled["outs"] == [2.5, 2.5]


LOOPBACK = textwrap.dedent('''
    import json, sys
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm_afd.attention.step import SIDECAR_KEY, AttentionStep, ForwardSidecar, register_afd_ops, register_step
    from vllm_afd.models.proxy import RemoteFFNProxy

    class LoopbackConnector:
        """Records the exchanges; its "FFN" doubles what was sent."""

        def __init__(self):
            self.calls, self.pending = [], None

        def send_a2f(self, stage, hidden, router_logits=None):
            self.calls.append(["send", stage, int(hidden.shape[0])])
            self.pending = hidden.clone()

        def recv_f2a(self, stage, out):
            self.calls.append(["recv", stage, int(out.shape[0])])
            if self.pending is None:
                raise RuntimeError("recv before any send")
            result, self.pending = self.pending * 2, None
            return result

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.mlp = RemoteFFNProxy(4)

        def forward(self, x):
            return self.mlp(self.linear(x)) + x

    register_afd_ops()
    connector = LoopbackConnector()
    sidecar = ForwardSidecar(register_step(AttentionStep(connector)), published=True)
    vllm_config = VllmConfig()
    torch.manual_seed(0)
    block, x = Block(), torch.randn(5, 16)
    with torch.no_grad():
        expected = block.linear(x) * 2 + x
        report = {}
        for backend in ("none", "eager", "inductor"):
            connector.calls.clear()
            run = block if backend == "none" else torch.compile(block, backend=backend, fullgraph=True)
            context = create_forward_context(None, vllm_config, additional_kwargs={SIDECAR_KEY: sidecar})
            try:
                with set_current_vllm_config(vllm_config), override_forward_context(context):
                    equal = bool(torch.allclose(run(x), expected))
                report[backend] = {"calls": connector.calls[:], "equal": equal, "error": None}
            except Exception as exc:  # reported, asserted on by the parent
                report[backend] = {"calls": connector.calls[:], "equal": False, "error": repr(exc)[:300]}
    print("REPORT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def loopback_report(children):
    return child_report(children["loopback"])


@pytest.mark.parametrize("backend", ["none", "eager", "inductor"])
def test_proxy_and_transport_ops_exchange_once_per_forward(loopback_report, backend):
    """Regression (inductor): with its output in a fresh buffer, the send was dead code."""
    result = loopback_report[backend]

    assert result["error"] is None
    assert result["calls"] == [["send", 0, 5], ["recv", 0, 5]]
    assert result["equal"]


WHOLE_MODEL = textwrap.dedent('''
    import json, sys
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_afd.attention.step import SIDECAR_KEY, AttentionStep, ForwardSidecar, register_afd_ops, register_step
    from vllm_afd.config import parse_afd_config
    from vllm_afd.models.qwen3_moe import AFDQwen3MoeForCausalLM
    from vllm_afd.workers.common import make_role_vllm_config

    class RecordingConnector:
        def __init__(self):
            self.calls = []

        def send_a2f(self, stage, hidden, router_logits=None):
            width = None if router_logits is None else int(router_logits.shape[1])
            self.calls.append(["send", int(hidden.shape[0]), width])

        def recv_f2a(self, stage, out):
            self.calls.append(["recv", int(out.shape[0])])
            return torch.zeros_like(out)

    register_afd_ops()
    connector = RecordingConnector()
    handle = register_step(AttentionStep(connector))
    report = {}
    for gate_on_attention in (False, True):
        config = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=256,
                            max_num_batched_tokens=256, additional_config={"afd": {
                                "role": "attention", "connector": "P2pGlooAFDConnector",
                                "compute_gate_on_attention": gate_on_attention}}).create_engine_config()
        config = make_role_vllm_config(config, parse_afd_config(config))  # the role worker's one parse
        with set_current_vllm_config(config):
            if not gate_on_attention:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
                ensure_model_parallel_initialized(1, 1)
            with set_default_torch_dtype(config.model_config.dtype):
                model = initialize_model(vllm_config=config, model_class=AFDQwen3MoeForCausalLM)
                get_model_loader(config.load_config).load_weights(model, config.model_config)
                process_weights_after_loading(model, config.model_config, torch.device("cpu"))
            runs = []
            for num_tokens in (6, 2):
                connector.calls.clear()
                sidecar = ForwardSidecar(handle, published=True)
                context = create_forward_context(None, config,
                                                 additional_kwargs={SIDECAR_KEY: sidecar})
                with torch.inference_mode(), override_forward_context(context):
                    model(torch.arange(num_tokens), torch.arange(num_tokens))
                runs.append(connector.calls[:])
            report[str(gate_on_attention)] = {"mode": str(config.compilation_config.mode),
                                              "compiled": bool(model.model.compiled), "runs": runs}
    print("REPORT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def whole_model_report(children):
    return child_report(children["whole_model"])


@pytest.mark.parametrize("gate_on_attention, crossing, width", [(False, [0, 1, 2], None),
                                                                 (True, [1, 2], 8)])
def test_compiled_attention_half_exchanges_layer_by_layer(whole_model_report, gate_on_attention,
                                                           crossing, width):
    """The decorated AFD model body under vLLM's default CPU compilation (Dynamo + inductor)."""
    result = whole_model_report[str(gate_on_attention)]

    assert result["compiled"] and "NONE" not in result["mode"]
    for run, num_tokens in zip(result["runs"], (6, 2)):
        expected = []
        for _ in crossing:  # exchanges are positional: the connector never sees a layer index
            expected += [["send", num_tokens, width], ["recv", num_tokens]]
        assert run == expected
