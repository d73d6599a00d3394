"""Plain (non-AFD) vLLM serves both tiny models on CPU with stable greedy tokens.

This is the baseline every AFD end-to-end test compares against: if plain vLLM is not
deterministic across repeats, batching and streaming, token equality "AFD on vs off"
means nothing. The servers are the session's plain servers (`plain_outputs`, conftest.py):
one per model, one at a time, and this module runs first, so they start once.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import pytest

from afd_harness.server import ServerStartError, VllmServer, chat, complete, complete_batch

pytestmark = pytest.mark.e2e

ARCHS = ["qwen3_moe", "deepseek_v2"]
MAX_TOKENS = 16
# Served in bf16, compared with fp32: rounding can flip a near-tie in the logits or in the
# router's top-k (seen: 0.21 on one of 64 tokens); a wrong kernel misses most tokens by more.
BF16_LOGIT_TOLERANCE = 0.5
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little robot who",
    "What is the capital of France?",
    "1, 2, 3,",
]


class Served(NamedTuple):
    arch: str
    model_dir: object  # pathlib.Path of the checkpoint
    server: VllmServer


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tiny_model_dir, plain_outputs, record_timing):
    # NOTE: the session's plain server of the model (conftest.py), the one whose tokens the AFD
    # tests compare against; test_zero_change proves it gives the pristine wheel's tokens.
    with plain_outputs.serving(request.param) as server:
        started = time.monotonic()
        first = complete(server.base_url, PROMPTS[0], MAX_TOKENS, ignore_eos=True)
        generate_s = time.monotonic() - started
        assert first.token_ids is not None and len(first.token_ids) == MAX_TOKENS, first
        record_timing(f"plain vLLM {request.param}: first {MAX_TOKENS}-token completion {generate_s:.2f} s")
        yield Served(request.param, tiny_model_dir(request.param), server)
    assert not server.is_running(), f"processes of group {server.pgid} outlived stop()"


def _greedy(served: Served, prompt, **fields):
    return complete(served.server.base_url, prompt, MAX_TOKENS, ignore_eos=True, **fields)


def test_greedy_completion_repeats_exactly(served):
    first = _greedy(served, PROMPTS[1])
    second = _greedy(served, PROMPTS[1])

    assert first == second
    assert len(first.token_ids) == MAX_TOKENS
    assert first.finish_reason == "length"


def test_greedy_tokens_differ_between_prompts(served):
    generations = [_greedy(served, prompt).token_ids for prompt in PROMPTS]

    assert len({tuple(ids) for ids in generations}) == len(PROMPTS)


def test_batched_completions_equal_one_by_one(served):
    one_by_one = [_greedy(served, prompt) for prompt in PROMPTS]

    batched = complete_batch(served.server.base_url, PROMPTS, MAX_TOKENS, ignore_eos=True)

    assert batched == one_by_one


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_streaming_equals_non_streaming(served, prompt):
    plain = _greedy(served, prompt)

    streamed = complete(served.server.base_url, prompt, MAX_TOKENS, stream=True, ignore_eos=True)

    assert streamed == plain


def test_token_id_prompt_equals_text_prompt(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    prompt_ids = tokenizer(PROMPTS[2])["input_ids"]

    by_text = _greedy(served, PROMPTS[2])
    by_ids = _greedy(served, prompt_ids)

    assert by_text.prompt_token_ids == prompt_ids
    assert by_ids.token_ids == by_text.token_ids


def test_greedy_tokens_are_transformers_top_choices(served):
    """Teacher-forced against transformers in fp32: every served greedy token is the top
    choice or within bf16 noise of it (catches CPU kernel bugs, tolerates rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32)
    shortfalls = []  # per generated token: max logit - logit of the served token
    for prompt in PROMPTS:
        generation = _greedy(served, prompt)
        num_prompt_tokens = len(generation.prompt_token_ids)
        ids = torch.tensor([generation.prompt_token_ids + generation.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, num_prompt_tokens - 1 : -1]  # [MAX_TOKENS, vocab]
        served_logits = logits.gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
        shortfalls += (logits.max(-1).values - served_logits).tolist()

    num_exact = sum(s == 0.0 for s in shortfalls)
    report = f"logit shortfalls: {[round(s, 3) for s in shortfalls]}"
    assert max(shortfalls) <= BF16_LOGIT_TOLERANCE, report
    assert num_exact >= 0.9 * len(shortfalls), report


def test_chat_completion_uses_the_chat_template(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected_prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]

    first = chat(served.server.base_url, messages, MAX_TOKENS, ignore_eos=True)
    second = chat(served.server.base_url, messages, MAX_TOKENS, ignore_eos=True)
    streamed = chat(served.server.base_url, messages, MAX_TOKENS, stream=True, ignore_eos=True)

    assert first.prompt_token_ids == expected_prompt_ids
    assert len(first.token_ids) == MAX_TOKENS
    assert first == second == streamed


def test_failed_start_raises_at_once_with_the_log_tail(vllm_python, tmp_path):
    server = VllmServer(
        tmp_path / "no-such-model", python=vllm_python, plugins=(), log_path=tmp_path / "server.log",
        startup_timeout_s=240,
    )
    started = time.monotonic()

    with pytest.raises(ServerStartError, match=r"server exited during startup \(exit code [1-9]"):
        server.start()

    assert time.monotonic() - started < 200
    assert "no-such-model" in server.log_tail()
    assert not server.is_running()
