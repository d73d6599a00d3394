"""Contract tests of the model seams (`qwen3-moe-*`, `deepseek-v2-*`) on the patched pinned source.

Each seam is a class attribute whose default is what the pinned release built inline. The main
test substitutes the defaults back into the patched class (`self.gate_cls` -> `ReplicatedLinear` on 0.30,
`GateLinear` on 0.32, `self.experts_apply_gate` -> `True`, `self_attn_cls` None -> the config's choice) and
checks that the class is then the pristine one, node for node: with the defaults the seams change nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hook_ast import find_def, parse

pytestmark = pytest.mark.wheel

try:  # the release under test (hook_series.pin_file): its router class
    from vllm_afd.releases import installed

    QWEN3_GATE = installed().qwen3_moe_gate_cls.rsplit(".", 1)[1]
except ImportError:
    QWEN3_GATE = "ReplicatedLinear"

QWEN3 = "vllm/model_executor/models/qwen3_moe.py"
DEEPSEEK = "vllm/model_executor/models/deepseek_v2.py"

# (file, class, {seam attribute: default as source}): every seam of the model patches.
SEAMS = [
    (QWEN3, "Qwen3MoeSparseMoeBlock", {"gate_cls": QWEN3_GATE, "experts_apply_gate": "True"}),
    (QWEN3, "Qwen3MoeDecoderLayer", {"self_attn_cls": "Qwen3MoeAttention",
                                     "moe_block_cls": "Qwen3MoeSparseMoeBlock",
                                     "mlp_cls": "Qwen3MoeMLP", "norm_cls": "RMSNorm"}),
    (QWEN3, "Qwen3MoeModel", {"embed_tokens_cls": "VocabParallelEmbedding", "norm_cls": "RMSNorm"}),
    (QWEN3, "Qwen3MoeForCausalLM", {"model_cls": "Qwen3MoeModel", "lm_head_cls": "ParallelLMHead"}),
    (DEEPSEEK, "DeepseekV2MoE", {"gate_cls": "GateLinear", "experts_apply_gate": "True"}),
    (DEEPSEEK, "DeepseekV2DecoderLayer", {"self_attn_cls": "None", "moe_block_cls": "DeepseekV2MoE",
                                          "mlp_cls": "DeepseekV2MLP", "norm_cls": "RMSNorm"}),
    (DEEPSEEK, "DeepseekV2Model", {"embed_tokens_cls": "VocabParallelEmbedding",
                                   "decoder_layer_cls": "DeepseekV2DecoderLayer", "norm_cls": "RMSNorm"}),
    (DEEPSEEK, "DeepseekV2ForCausalLM", {"lm_head_cls": "ParallelLMHead"}),
]
IDS = [cls for _, cls, _ in SEAMS]


def find_class(module: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)


def seam_defaults(cls: ast.ClassDef) -> dict[str, str]:
    """Annotated class attributes whose name ends like a seam's, with their defaults as source."""
    return {
        node.target.id: ast.unparse(node.value)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and node.value is not None
        and (node.target.id.endswith("_cls") or node.target.id == "experts_apply_gate")
    }


class _WithDefaults(ast.NodeTransformer):
    """The class as it runs with the seams' defaults, the seam attributes removed."""

    def __init__(self, defaults: dict[str, str]) -> None:
        self.defaults = defaults

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.body = [stmt for stmt in node.body if not (
            isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) in self.defaults)]
        self.generic_visit(node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if ast.unparse(node.value) == "self" and node.attr in self.defaults:
            return ast.parse(self.defaults[node.attr], mode="eval").body
        return self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node

    def visit_If(self, node: ast.If) -> ast.AST | None:
        self.generic_visit(node)
        test = node.test
        constant = isinstance(test, ast.Compare) and all(
            isinstance(x, ast.Constant) for x in (test.left, *test.comparators))
        folded = constant and eval(compile(ast.fix_missing_locations(ast.Expression(test)), "<seam>", "eval"))
        if constant and not folded and not node.orelse:
            return None  # a branch the default never takes
        return node


@pytest.mark.parametrize(("relpath", "cls_name", "expected"), SEAMS, ids=IDS)
def test_seam_defaults_are_the_classes_the_pinned_release_builds(
    pinned_tree: Path, relpath: str, cls_name: str, expected: dict[str, str]
) -> None:
    cls = find_class(parse(pinned_tree, relpath), cls_name)

    assert seam_defaults(cls) == expected


@pytest.mark.parametrize(("relpath", "cls_name", "expected"), SEAMS, ids=IDS)
def test_with_the_defaults_the_patched_class_is_the_pristine_one(
    pinned_tree: Path, pristine_tree: Path, relpath: str, cls_name: str, expected: dict[str, str]
) -> None:
    patched = find_class(parse(pinned_tree, relpath), cls_name)
    pristine = find_class(parse(pristine_tree, relpath), cls_name)

    substituted = _WithDefaults(expected).visit(patched)

    assert ast.dump(substituted) == ast.dump(pristine)


@pytest.mark.parametrize(("relpath", "cls_name", "expected"), SEAMS, ids=IDS)
def test_every_seam_is_read_in_the_constructor(
    pinned_tree: Path, relpath: str, cls_name: str, expected: dict[str, str]
) -> None:
    init = find_def(parse(pinned_tree, relpath), f"{cls_name}.__init__")

    read = {node.attr for node in ast.walk(init)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self"}

    assert set(expected) <= read


def test_deepseek_attention_override_sits_after_the_config_choice(pinned_tree: Path) -> None:
    init = find_def(parse(pinned_tree, DEEPSEEK), "DeepseekV2DecoderLayer.__init__")
    source = [ast.unparse(stmt) for stmt in init.body]

    choice = next(i for i, s in enumerate(source) if s.startswith("if use_mha:\n    attn_cls"))
    override = source.index("if self.self_attn_cls is not None:\n    attn_cls = self.self_attn_cls")
    built = next(i for i, s in enumerate(source) if s.startswith("self.self_attn = attn_cls("))

    assert choice + 1 == override < built


@pytest.mark.parametrize("relpath", [QWEN3, DEEPSEEK])
def test_fused_experts_get_the_router_unless_the_block_says_otherwise(
    pinned_tree: Path, relpath: str
) -> None:
    module = parse(pinned_tree, relpath)
    block = "Qwen3MoeSparseMoeBlock" if relpath == QWEN3 else "DeepseekV2MoE"
    init = find_def(module, f"{block}.__init__")

    factory = next(node for node in ast.walk(init) if isinstance(node, ast.Call)
                   and ast.unparse(node.func) == "FusedMoEFactory")
    gate = next(kw.value for kw in factory.keywords if kw.arg == "gate")

    assert ast.unparse(gate) == "self.gate if self.experts_apply_gate else None"
