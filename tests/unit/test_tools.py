"""Typed-function tools: schemas, the Hermes parser, validation, timeouts and exceptions, chat templates."""

import random
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from agentrl.envs import SearchEnv, ToolEnv, parse_hermes_tool_calls, search_tasks, tool_schema
from agentrl.envs.calculator import CalculatorToolEnv, calculator_tasks, chat_calculator_demonstration
from agentrl.envs.search import index_for, search_demonstration, search_practice_tasks, search_query
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


def test_recovered_bad_calls_cost_only_when_asked_and_only_in_episodes_a_call_rescued():
    env = ToolEnv([add, broken], check=lambda task, answer: answer == task["answer"],
                  rewards={"recovered_bad_call": -0.25})
    env.reset({"question": "What is 2 + 3?", "answer": "5"})
    env.step("Action: broken(now)\n")  # failed call
    env.step("Action: add(2, 3, 4\n")  # malformed call
    env.step('Action: add({"a": 2, "b": 3})\n')
    final = env.step("Answer: 5")
    assert final.reward == 1.0 - 2 * 0.25 and final.info["format_errors"] == 2
    env.reset({"question": "What is 2 + 3?", "answer": "5"})
    env.step("Action: broken(now)\n")
    final = env.step("Answer: 5")  # nothing rescued it: the tutorial's table alone
    assert final.reward == env.rewards.malformed_call


@pytest.mark.parametrize("run_last, reward, calls", [(False, -1.0, 0), (True, 0.2, 1)])
def test_a_call_in_the_last_turn_runs_and_counts_only_when_asked(run_last, reward, calls):
    ran = []

    def note(x: str) -> str:
        """Remember x.

        Args:
            x: anything
        """
        ran.append(x)
        return "noted"

    env = ToolEnv([note], check=lambda task, answer: answer == task["answer"], max_turns=1,
                  run_last_turn_calls=run_last)
    env.reset({"question": "q", "answer": "a"})
    final = env.step("Action: note(hello)\n")
    assert final.done and final.observation is None
    assert final.reward == reward and final.info["tool_calls"] == calls and ran == ["hello"] * calls

@pytest.mark.parametrize("relation", ["capital", "longest river", "founder"])
def test_search_env_finds_the_fictional_fact(relation):
    task = next(t for t in search_tasks(100, seed=0, split="eval") if f"the {relation} of" in t["question"])
    env = SearchEnv()
    env.reset(task)
    r = env.step(f"Action: search({search_query(task['question'])})\n")
    first_hit = r.observation.removeprefix("Observation: ").split(". ")[0]
    assert task["answer"] in first_hit  # BM25 ranks the fact that answers the question first
    assert env.step(f"Answer: {task['answer']}").reward == 1.0
    assert not set(t["question"] for t in search_tasks(100, split="eval")) & set(
        t["question"] for t in search_tasks(2000, split="train"))


def test_every_search_question_retrieves_its_fact_first():
    """Answers are never subjects, so no other fact shares a query's words (BM25 ignores word order)."""
    tasks = search_tasks(2000, split="train") + search_tasks(2000, split="eval")
    index = index_for(None)
    assert len(tasks) == 1200
    assert all(index.top(search_query(t["question"]), 1)[0].startswith(t["answer"] + " ") for t in tasks)


def test_search_base_model_practises_on_another_world():
    env_world = {t["question"]: t["answer"] for t in search_tasks(2000, split="train") + search_tasks(2000, split="eval")}
    practice = search_practice_tasks(500, split="train", unique=False)
    shared = [t for t in practice if t["question"] in env_world]
    assert practice and all(t["answer"] != env_world[t["question"]] for t in shared)  # no answer carries over
    demo = search_demonstration(practice[0], True, random.Random(0))
    assert practice[0]["answer"] in demo[2][0]  # the observation holds the practice world's fact


@pytest.fixture()
def chat_tokenizer(tiny_base):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


def test_templates_that_rewrite_history_are_appended_to_and_one_that_hides_a_turn_is_named(chat_tokenizer):
    renderer = ChatRenderer.for_tokenizer(chat_tokenizer, [tool_schema(add)])
    assert renderer.turn_end == "<|im_end|>"
    rewriting = AutoTokenizer.from_pretrained(chat_tokenizer.name_or_path)
    # Renders only the last two messages: history is rewritten as the conversation grows, yet the text of the
    # new messages is still the template's own.
    rewriting.chat_template = ("{% for m in messages[-2:] %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    renderer = ChatRenderer.for_tokenizer(rewriting, [tool_schema(add)])
    renderer.start([{"role": "user", "content": "What is 2 + 2?"}])
    assistant = {"role": "assistant", "content": "<call>"}
    assert renderer.tool_turn("<call></s>", assistant, [{"role": "tool", "content": "4"}]) == "<tool>4</s><assistant>"
    # Renders no assistant message at all: where the turn ends cannot be told, and the error says whose template
    hiding = AutoTokenizer.from_pretrained(chat_tokenizer.name_or_path)
    hiding.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' %}<{{ m.role }}>{{ m.content }}</s>"
                            "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    renderer = ChatRenderer(hiding, [tool_schema(add)], "</s>")
    renderer.start([{"role": "user", "content": "What is 2 + 2?"}])
    with pytest.raises(TemplateDriftError, match=r"chat template of .*model: message 2 \(tool\): cannot find where "
                                                 r"assistant message 1 ends"):
        renderer.tool_turn("<call></s>", assistant, [{"role": "tool", "content": "4"}])


class ScriptedLM(torch.nn.Module):
    """Writes a fixed token sequence, one token per forward call, whatever the context: a model whose
    turns we choose, so a test can check what the rollout engine appends around them."""

    def __init__(self, script: list[int], vocab_size: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the sampler reads the device from the parameters
        self.script, self.vocab_size = list(script), vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None):
        logits = torch.full((*input_ids.shape, self.vocab_size), -1e9)
        logits[:, -1, self.script.pop(0)] = 0.0
        return SimpleNamespace(logits=logits)


def test_chat_rollout_ids_are_the_template_rendering_of_the_conversation(chat_tokenizer):
    """The model samples its own turn-end token; the engine must append the tool message after it, exactly
    as the template renders the whole conversation (no doubled or missing markers)."""
    from agentrl.rollout import SamplingParams, rollout

    task = {"question": "What is 2 + 3?", "answer": "5", "expression": "2 + 3"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    turns = [call + "<|im_end|>", "The answer is 5<|im_end|>"]
    script = [i for t in turns for i in chat_tokenizer(t, add_special_tokens=False)["input_ids"]]
    model = ScriptedLM(script, len(chat_tokenizer))
    ep = rollout(model, chat_tokenizer, lambda: CalculatorToolEnv(format="chat"), [task],
                 SamplingParams(max_new_tokens=256, do_sample=False))[0]
    assert ep.info["correct"] and ep.score == 1.0 and ep.num_turns == 2
    env = CalculatorToolEnv(format="chat")
    messages = [{"role": "user", "content": task["question"]}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5"}]
    rendered = chat_tokenizer.apply_chat_template(messages, tools=env.schemas, tokenize=False)
    expected = chat_tokenizer(rendered)["input_ids"]
    got = ep.prompt_ids + ep.token_ids
    assert got == expected[:len(got)] and chat_tokenizer.decode(expected[len(got):]) == "\n"
    # the episode's messages (the call as structured tool_calls) render to the same text
    assert chat_tokenizer.apply_chat_template(ep.messages, tools=ep.tools, tokenize=False) == rendered
    # 1 exactly on what the model wrote, 0 on the tool message and the next generation prompt
    sampled = [t for t, m in zip(ep.token_ids, ep.loss_mask) if m]
    assert sampled == script


def test_chat_turn_ending_in_eos_ends_the_episode(chat_tokenizer):
    from agentrl.rollout import SamplingParams, rollout

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    script = chat_tokenizer(call, add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
    task = {"question": "What is 2 + 3?", "answer": "5"}
    ep = rollout(ScriptedLM(script, len(chat_tokenizer)), chat_tokenizer, lambda: CalculatorToolEnv(format="chat"),
                 [task], SamplingParams(max_new_tokens=256, do_sample=False))[0]
    assert ep.done and ep.num_turns == 1 and ep.score == -1.0 and not ep.info["correct"]


def test_chat_demonstrations_are_what_the_template_renders(chat_tokenizer):
    env = CalculatorToolEnv(format="chat")
    env.bind_tokenizer(chat_tokenizer)
    for use_tool in (True, False):
        task = calculator_tasks(1, split="eval")[0]
        demo = chat_calculator_demonstration(task, use_tool, random.Random(0))
        assert env.reset(task) == demo[0][0]
        if use_tool:
            observation = env.step(demo[1][0]).observation
            assert observation == demo[2][0]
            assert env.step(demo[3][0]).reward == 1.0


def test_chat_preference_rows_are_messages_the_template_renders_back(chat_tokenizer):
    """Pairs written from chat episodes keep messages and tools, so offline DPO on the file sees the
    policy's own prompt ids and masks the tool result."""
    from agentrl.preferences import pair_to_row, tokenize_row
    from agentrl.rollout import SamplingParams, rollout

    task = {"question": "What is 2 + 3?", "answer": "5"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'

    def episode(turns):
        script = [i for t in turns for i in chat_tokenizer(t, add_special_tokens=False)["input_ids"]]
        return rollout(ScriptedLM(script, len(chat_tokenizer)), chat_tokenizer, lambda: CalculatorToolEnv(format="chat"),
                       [task], SamplingParams(max_new_tokens=256, do_sample=False))[0]

    best, worst = episode([call + "<|im_end|>", "The answer is 5<|im_end|>"]), episode(["I think it is 6<|im_end|>"])
    row = pair_to_row(best, worst, chat_tokenizer)
    assert row["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    (call_id,) = [c["id"] for c in row["chosen"][0]["tool_calls"]]
    assert row["chosen"] == [{"role": "assistant", "content": "", "tool_calls": [
                                 {"id": call_id, "type": "function",
                                  "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]},
                             {"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": "5"},
                             {"role": "assistant", "content": "The answer is 5"}]
    assert row["rejected"] == [{"role": "assistant", "content": "I think it is 6"}]
    assert row["tools"][0]["function"]["name"] == "calculator"
    example = tokenize_row(row, chat_tokenizer, "row 1", max_length=512, max_prompt_length=256)
    assert example.prompt_ids == best.prompt_ids
    tool_ids = chat_tokenizer("<|im_start|>tool\n5<|im_end|>", add_special_tokens=False)["input_ids"]
    ids, mask = example.chosen_ids, example.chosen_mask
    start = next(i for i in range(len(ids)) if ids[i:i + len(tool_ids)] == tool_ids)
    assert mask[start:start + len(tool_ids)] == [0] * len(tool_ids) and sum(mask) > 0
    # the mask is 1 on exactly what the policy wrote in the rollout: the same tokens, in the same order
    assert [t for t, m in zip(ids, mask) if m] == [t for t, m in zip(best.token_ids, best.loss_mask) if m]
    assert ids[:len(best.token_ids)] == best.token_ids
