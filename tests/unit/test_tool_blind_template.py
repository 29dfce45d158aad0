"""A chat template that renders neither `tools=` nor assistant `tool_calls` (SmolLM2's, reproduced by a small
template of our own): agentrl writes the schemas into the system message and the calls as Hermes text, in
rollouts, SFT rows and DPO rows alike, warns once, and token-in-token-out stays exact."""

import json
import warnings

import pytest

from agentrl.envs import calculator, tool_schema
from agentrl.envs import chat as chat_module
from agentrl.envs.chat import conversation_segments, render, template_tool_support
from agentrl.preferences import pair_to_row, tokenize_row
from agentrl.trainers.sft import encode_demonstrations

from test_chat_templates import CHATML_TOKENS, appended_segments, family_tokenizer, run

# Like SmolLM2-Instruct's: a default system prompt, role and content only.
TOOL_BLIND = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 * 5"}}\n</tool_call><|im_end|>'


@pytest.fixture
def tok(tiny_base):
    chat_module._SUPPORT.clear()  # the support probe (and its warning) is cached per template
    return family_tokenizer(tiny_base, TOOL_BLIND, CHATML_TOKENS, "<|bos|>", "<|im_end|>")


def test_detected_and_warned_once(tok):
    with pytest.warns(UserWarning, match="renders no tools= and assistant tool_calls: agentrl writes the tool schemas"):
        support = template_tool_support(tok)
    assert not support.tools and not support.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        template_tool_support(tok)  # cached: no second warning


def test_rollout_prompt_carries_the_tools_and_ids_stay_exact(tok):
    with pytest.warns(UserWarning):
        ep, model, pieces, env = run(tok, [CALL, "The answer is 25<|im_end|>"])
    prompt = tok.decode(ep.prompt_ids)
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt  # schema and call format in the system turn
    assert "You are a helpful assistant." not in prompt  # our system message replaces the template's default
    (segment,) = appended_segments(tok, ep, model, pieces)  # the exact-ids and mask check
    assert segment == "\n<|im_start|>tool\n25<|im_end|>\n<|im_start|>assistant\n"
    assert ep.info["correct"] and ep.info["tool_calls"] == 1 and ep.score == 1.0


def test_sft_rows_from_structured_calls_train_on_the_call_text(tok):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "5 * 5"}}}
    messages = [{"role": "user", "content": "What is 5 * 5?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "25"}, {"role": "assistant", "content": "The answer is 25"}]
    tools = [tool_schema(calculator)]
    with pytest.warns(UserWarning):
        segments = conversation_segments(tok, messages[:1], messages[1:], tools)
    assert segments[0] == (CALL, True)  # not an empty turn
    assert segments[1] == ("\n<|im_start|>tool\n25<|im_end|>\n<|im_start|>assistant\n", False)
    ((ids, labels),), _, _ = encode_demonstrations([("row 1", {"messages": messages, "tools": tools})], tok)
    trained = tok.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained == CALL + "The answer is 25<|im_end|>"
    assert render(tok, messages[:1], tools, True).startswith("<|im_start|>system\nYou can call these tools:")


def test_dpo_rows_render_the_calls_as_sampled(tok):
    with pytest.warns(UserWarning):
        best = run(tok, [CALL, "The answer is 25<|im_end|>"])[0]
    worst = run(tok, ["I think it is 24<|im_end|>", "unused<|im_end|>"])[0]
    row = json.loads(json.dumps(pair_to_row(best, worst, tok)))  # as written to and read from JSONL
    example = tokenize_row(row, tok, "row 1", max_length=1024, max_prompt_length=512)
    assert example.prompt_ids == best.prompt_ids
    assert example.chosen_ids == best.token_ids and example.chosen_mask == best.loss_mask
