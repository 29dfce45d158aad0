"""Typed-function tools: schemas, the Hermes parser, validation, timeouts and exceptions, chat templates."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs import SearchEnv, ToolEnv, parse_hermes_tool_calls, search_tasks, tool_schema
from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE, ChatRenderer, TemplateDriftError
from agentrl.envs.tools import ToolCall, ToolRunner


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def lookup(query: str, limit: int = 3) -> str:
    """Look something up.

    Args:
        query: what to look for
        limit: how many results
    """
    return query


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("disk on fire")


def test_schemas_come_from_signatures_and_docstrings():
    s = tool_schema(add)["function"]
    assert s["name"] == "add" and s["description"] == "Add two integers."
    assert s["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert s["parameters"]["required"] == ["a", "b"]
    assert tool_schema(lookup)["function"]["parameters"]["required"] == ["query"]


def test_hermes_parser_good_multiple_malformed_truncated():
    calls, errors = parse_hermes_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert calls == [ToolCall("add", {"a": 1, "b": 2})] and errors == []
    text = ('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y '
            '<tool_call>{"name": "lookup", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>')
    calls, errors = parse_hermes_tool_calls(text)
    assert [c.name for c in calls] == ["add", "lookup"] and calls[1].arguments == {"query": "q"}
    calls, errors = parse_hermes_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')
    assert calls == [] and "not valid JSON" in errors[0]
    calls, errors = parse_hermes_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert "name" in errors[0]
    calls, errors = parse_hermes_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1')
    assert calls == [] and "truncated" in errors[0]
    assert parse_hermes_tool_calls("no calls here") == ([], [])


def test_runner_validates_times_out_and_catches_exceptions():
    run = ToolRunner([add, slow, broken], timeout=0.2, max_observation_chars=20)
    assert run(ToolCall("add", {"a": 2, "b": 3})) == ("5", True)
    assert "unknown tool 'mul'" in run(ToolCall("mul", {}))[0]
    assert "missing argument 'b'" in run(ToolCall("add", {"a": 1}))[0]
    assert "must be integer" in run(ToolCall("add", {"a": "1", "b": 2}))[0]
    assert "unknown argument 'c'" in run(ToolCall("add", {"a": 1, "b": 2, "c": 3}))[0]
    started = time.time()
    text, ok = run(ToolCall("slow", {"seconds": 2.0}))
    assert not ok and "timed out" in text and time.time() - started < 1.0
    text, ok = ToolRunner([broken])(ToolCall("broken", {"x": "y"}))
    assert not ok and text.startswith("Error: broken raised RuntimeError")
    assert len(run(ToolCall("add", {"a": 10 ** 30, "b": 1}))[0]) <= 20 + len(" ...[truncated]")


def test_tool_env_react_format_counts_failures():
    env = ToolEnv([add, broken], check=lambda task, answer: answer == task["answer"])
    env.reset({"question": "What is 2 + 3?", "answer": "5"})
    r = env.step('Action: add({"a": 2, "b": 3})\n')
    assert r.observation == "Observation: 5\n" and not r.done
    r = env.step("Action: broken(now)\n")
    assert "raised RuntimeError" in r.observation
    final = env.step("Answer: 5")
    assert final.done and final.reward == 1.0 and final.info["tool_failures"] == 1


def test_search_env_finds_the_fictional_fact():
    task = search_tasks(1, seed=0, split="eval")[0]
    env = SearchEnv()
    env.reset(task)
    subject = task["question"].removeprefix("What is the ").removeprefix("Who founded ").rstrip("?")
    r = env.step(f"Action: search({subject})\n")
    assert task["answer"] in r.observation
    assert env.step(f"Answer: {task['answer']}").reward == 1.0
    assert not set(t["question"] for t in search_tasks(100, split="eval")) & set(
        t["question"] for t in search_tasks(2000, split="train"))


@pytest.fixture()
def chat_tokenizer(tiny_base):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


def test_prefix_preserving_template_passes_and_a_rewriting_one_is_named(chat_tokenizer):
    renderer = ChatRenderer.for_tokenizer(chat_tokenizer, [tool_schema(add)])
    assert renderer.turn_end == "<|im_end|>"
    rewriting = AutoTokenizer.from_pretrained(chat_tokenizer.name_or_path)
    # Renders only the last two messages: history is rewritten as the conversation grows.
    rewriting.chat_template = ("{% for m in messages[-2:] %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    with pytest.raises(TemplateDriftError, match="not prefix-preserving"):
        ChatRenderer.for_tokenizer(rewriting, [tool_schema(add)])


def test_chat_rollout_masks_tool_messages(tiny_base, chat_tokenizer):
    from agentrl.rollout import SamplingParams, rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    model.resize_token_embeddings(len(chat_tokenizer))
    plan = iter(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'])

    class Scripted(ToolEnv):
        def step(self, action):
            return super().step(next(plan, action))

    env_factory = lambda: Scripted([add], check=lambda t, a: a == t["answer"], format="chat")  # noqa: E731
    ep = rollout(model.eval(), chat_tokenizer, env_factory, [{"question": "What is 2 + 3?", "answer": "5"}],
                 SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0))[0]
    assert ep.info["tool_calls"] == 1
    tool_ids = chat_tokenizer("<|im_start|>tool\n5<|im_end|>", add_special_tokens=False)["input_ids"]
    starts = [i for i in range(len(ep.token_ids)) if ep.token_ids[i:i + len(tool_ids)] == tool_ids]
    assert starts and ep.loss_mask[starts[0]:starts[0] + len(tool_ids)] == [0] * len(tool_ids)
