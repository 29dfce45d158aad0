"""Tool-calling chat templates of the families people train, reproduced by small templates of our own (the
published ones are not copied here): Qwen3 rewriting <think> in history, Llama 3's ipython role with JSON calls
and today's date in the system header, Mistral's [TOOL_CALLS] with 9-character ids and a system prompt that moves,
Hermes' tool_use template. Each runs through the rollout engine with a scripted policy and the exact-ids check:
the ids trained are the ids the policy saw plus what it sampled, the mask is 1 exactly on sampled tokens, and
each appended segment is the template's own text for the tool results, ending with its generation prompt."""

import datetime
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoTokenizer

import agentrl
from agentrl.config import apply_overrides
from agentrl.envs import ToolEnv, calculator, detect_tool_parser, make_env
from agentrl.envs import parse_llama3_json_tool_calls, parse_mistral_tool_calls
from agentrl.envs.calculator import numeric_match
from agentrl.envs.chat import TemplateDriftError
from agentrl.preferences import pair_to_row, tokenize_row
from agentrl.rollout import SamplingParams, episode_metrics, rollout

# Qwen3-like: tool results go into a user turn as <tool_response> blocks (consecutive ones share the turn);
# reasoning is rendered only for assistant turns after the last user message that are last or non-empty, so an
# empty <think></think> the model wrote disappears from history once a tool result follows.
QWEN3 = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{% set reasoning = '' %}"
    "{%- if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{% endif %}{{ content }}"
    "{%- for c in m.tool_calls or [] %}{% if content or not loop.first %}{{ '\n' }}{% endif %}"
    "{{- '<tool_call>\n' }}{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "{{- '\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{%- endif %}"
)

# Llama 3-like: today's date in the system header, tools in the first user message, one JSON call per turn with
# "parameters" (more raise), results in the ipython role.
LLAMA3 = (
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\n\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% set messages = messages[1:] %}{% endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{%- if loop.first and tools %}Functions:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\n\n' }}"
    "{%- endif %}{{ m.content | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in m %}"
    "{%- if m.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls') }}{% endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{{- {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}"
    "{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- else %}{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-like: the tool list before the last user message and the system prompt inside it only while it is the
# last message (both move as the conversation grows); [TOOL_CALLS] with 9-character ids the template checks;
# results as [TOOL_RESULTS] with the call id; no generation prompt.
MISTRAL = (
    "{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set msgs = messages[1:] %}"
    "{%- else %}{% set msgs = messages %}{% endif %}"
    "{%- set users = msgs | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}{% for m in msgs %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == users[-1] %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t.function.name }}{% endfor %}"
    "[/AVAILABLE_TOOLS]{% endif %}"
    "{%- if loop.last and system is defined %}{{ '[INST]' + system + '\n\n' + m.content + '[/INST]' }}"
    "{%- else %}{{ '[INST]' + m.content + '[/INST]' }}{% endif %}"
    "{%- elif m.tool_calls is defined %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{%- if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + eos_token }}"
    "{%- else %}{% if m.tool_call_id | length != 9 %}{{ raise_exception('bad tool_call_id') }}{% endif %}"
    "[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{%- endif %}{% endfor %}"
)

# Hermes-like (tool_use): results in a `tool` turn; the last tool message closes without the newline a non-last
# one gets, so that turn re-renders once the next assistant turn follows.
HERMES = (
    "{{- bos_token + '<|im_start|>system\nTools:' }}{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' or (m.role == 'assistant' and m.tool_calls is not defined) %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}{{ '\n<tool_call>\n' }}"
    "{{- {'arguments': c.function.arguments, 'name': c.function.name} | tojson }}{{ '\n</tool_call>' }}{% endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.previtem and loop.previtem.role != 'tool' %}{{ '<|im_start|>tool\n' }}{% endif %}"
    "{{- '<tool_response>\n' + m.content }}"
    "{%- if not loop.last %}{{ '\n</tool_response>\n' }}{% else %}{{ '\n</tool_response>' }}{% endif %}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{% endif %}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
TASK = {"question": "What is (2 + 3) * (4 + 1)?", "answer": "25"}


def family_tokenizer(tiny_base, template, special, bos, eos):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos,
                            "additional_special_tokens": [t for t in special if t not in (bos, eos)]})
    tok.chat_template = template
    return tok


class ScriptedLM(torch.nn.Module):
    """Writes a fixed token sequence whatever the context and records the context each turn starts from."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the sampler reads the device from the parameters
        self.script, self.vocab_size, self.contexts = list(script), vocab_size, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None):
        if input_ids.shape[1] > 1:  # the first forward of a turn sees the whole context (one row, no padding)
            self.contexts.append(input_ids[0].tolist())
        logits = torch.full((*input_ids.shape, self.vocab_size), -1e9)
        logits[:, -1, self.script.pop(0)] = 0.0
        return SimpleNamespace(logits=logits)


def run(tok, turns, **env_kwargs):
    pieces = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
    model = ScriptedLM([i for p in pieces for i in p], len(tok))
    envs = []

    def factory():
        envs.append(ToolEnv([calculator], check=numeric_match, format="chat", max_turns=len(turns), **env_kwargs))
        return envs[-1]

    ep = rollout(model, tok, factory, [TASK], SamplingParams(max_new_tokens=160, do_sample=False))[0]
    return ep, model, pieces, envs[0]


def appended_segments(tok, ep, model, pieces) -> list[str]:
    """The exact-ids check; returns the appended (mask 0) segments as text."""
    ids = ep.prompt_ids + ep.token_ids
    assert len(model.contexts) == len(pieces)
    mask = [0] * len(ep.token_ids)
    for context, piece in zip(model.contexts, pieces):
        assert ids[:len(context) + len(piece)] == context + piece  # trained == what the policy saw + sampled
        start = len(context) - len(ep.prompt_ids)
        mask[start:start + len(piece)] = [1] * len(piece)
    assert ids == model.contexts[-1] + pieces[-1]
    assert ep.loss_mask == mask  # 1 exactly on sampled tokens
    segments, start = [], None
    for j, m in enumerate(ep.loss_mask + [1]):
        if m == 0 and start is None:
            start = j
        elif m == 1 and start is not None:
            segments.append(tok.decode(ep.token_ids[start:j]))
            start = None
    return segments


def generation_prompt(tok, messages, tools, **kwargs) -> str:
    with_gp = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    plain = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    return with_gp[len(plain):]


PARALLEL = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4 + 1"}}\n</tool_call><|im_end|>')
SINGLE = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 * 5"}}\n</tool_call><|im_end|>'


def test_qwen3_like_template_rewriting_think_in_history(tiny_base):
    tok = family_tokenizer(tiny_base, QWEN3, CHATML_TOKENS, "<|bos|>", "<|im_end|>")
    turns = ["<think>\nTwo sums first.\n</think>\n\n" + PARALLEL, "<think>\n\n</think>\n\n" + SINGLE,
             "<think>\nDone.\n</think>\n\nThe answer is 25<|im_end|>"]
    ep, model, pieces, env = run(tok, turns)
    assert env.tool_parser == "hermes" and ep.info["correct"] and ep.info["tool_calls"] == 3 and ep.score == 1.0
    first, second = appended_segments(tok, ep, model, pieces)
    # both parallel results in one user turn, in one rendering, then the generation prompt
    assert first == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n5\n</tool_response>"
                     "<|im_end|>\n<|im_start|>assistant\n")
    assert second.endswith("<tool_response>\n25\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the template itself rewrites history (the empty think block is gone): re-rendering would have drifted
    rendered = tok.apply_chat_template(ep.messages, tools=ep.tools, tokenize=False)
    assert "<think>\n\n</think>" in tok.decode(ep.token_ids) and "<think>\n\n</think>" not in rendered
    # the assistant turns are structured tool calls with ids; the reasoning stays in the content
    assistant = ep.messages[1]
    assert assistant["content"] == "<think>\nTwo sums first.\n</think>"
    assert [c["function"] for c in assistant["tool_calls"]] == [
        {"name": "calculator", "arguments": {"expression": "2 + 3"}},
        {"name": "calculator", "arguments": {"expression": "4 + 1"}}]
    assert [m["tool_call_id"] for m in ep.messages[2:4]] == [c["id"] for c in assistant["tool_calls"]]


def test_template_arguments_reach_the_template(tiny_base):
    tok = family_tokenizer(tiny_base, QWEN3, CHATML_TOKENS, "<|bos|>", "<|im_end|>")
    kwargs = {"enable_thinking": False}
    ep, model, pieces, _ = run(tok, [SINGLE, "The answer is 25<|im_end|>"], chat_template_kwargs=kwargs)
    assert tok.decode(ep.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    (segment,) = appended_segments(tok, ep, model, pieces)
    assert segment.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ep.info["correct"] and ep.chat_template_kwargs == kwargs
    # the same keys in a YAML config's env kwargs (here as command-line overrides of the shipped chat config)
    config = yaml.safe_load((Path(agentrl.__file__).parent / "configs" / "chat.yaml").read_text())
    config = apply_overrides(config, ["env.kwargs.tool_parser=llama3_json",
                                      "env.kwargs.chat_template_kwargs.enable_thinking=false"])
    env = make_env(config["env"]["name"], config["env"]["kwargs"])
    assert env.tool_parser == "llama3_json" and env.chat_template_kwargs == kwargs
    with pytest.raises(ValueError, match="tool_parser must be one of hermes, llama3_json, mistral"):
        ToolEnv([calculator], check=numeric_match, format="chat", tool_parser="qwen")


def test_llama3_like_template_ipython_role_and_a_new_date_every_render(tiny_base, monkeypatch):
    import transformers.utils.chat_template_utils as ctu

    class Clock(datetime.datetime):  # every rendering happens a day later: the system header changes each time
        calls = 0

        @classmethod
        def now(cls, tz=None):
            cls.calls += 1
            return datetime.datetime(2025, 1, 1) + datetime.timedelta(days=cls.calls)

    monkeypatch.setattr(ctu, "datetime", Clock)
    tok = family_tokenizer(tiny_base, LLAMA3, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>")
    turns = ['{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot_id|>',
             '<|python_tag|>{"name": "calculator", "parameters": {"expression": "5 * 5"}}<|eom_id|>',
             "The answer is 25<|eot_id|>"]
    ep, model, pieces, env = run(tok, turns, system_prompt="Use the tools.")
    assert env.tool_parser == "llama3_json" and ep.info["correct"] and ep.info["tool_calls"] == 2
    assert ep.prompt_ids[:2] == tok("<|begin_of_text|><|start_header_id|>", add_special_tokens=False)["input_ids"]
    first, second = appended_segments(tok, ep, model, pieces)  # <|eom_id|> ended the second turn
    assert first == ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert second == first.replace("5", "25")
    assert Clock.calls >= 5 and ep.messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "2 + 3"}


def test_mistral_like_template_call_ids_and_a_moving_system_prompt(tiny_base):
    tok = family_tokenizer(tiny_base, MISTRAL, MISTRAL_TOKENS, "<s>", "</s>")
    turns = ['[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2 + 3"}, "id": "a1B2c3D4e"}, '
             '{"name": "calculator", "arguments": {"expression": "4 + 1"}}]</s>',
             "The answer is 25</s>"]
    ep, model, pieces, env = run(tok, turns, system_prompt="Use the tools.")
    assert env.tool_parser == "mistral" and ep.info["correct"] and ep.info["tool_calls"] == 2
    assert "[INST]Use the tools.\n\n" in tok.decode(ep.prompt_ids)
    (segment,) = appended_segments(tok, ep, model, pieces)
    made_up = ep.messages[2]["tool_calls"][1]["id"]  # the model wrote no id for the second call
    assert re.fullmatch(r"[A-Za-z0-9]{9}", made_up)
    assert segment == ('[TOOL_RESULTS]{"content": "5", "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'
                       '[TOOL_RESULTS]{"content": "5", "call_id": "%s"}[/TOOL_RESULTS]' % made_up)
    # re-rendering would have moved the system prompt away from the prompt the policy saw
    assert "Use the tools." not in tok.apply_chat_template(ep.messages, tools=ep.tools, tokenize=False)


def test_hermes_like_template_last_tool_message_rerendered(tiny_base):
    tok = family_tokenizer(tiny_base, HERMES, CHATML_TOKENS, "<|bos|>", "<|im_end|>")
    ep, model, pieces, env = run(tok, [PARALLEL, SINGLE, "The answer is 25<|im_end|>"])
    assert env.tool_parser == "hermes" and ep.info["correct"] and ep.info["tool_calls"] == 3
    first, second = appended_segments(tok, ep, model, pieces)
    assert first == ("\n<|im_start|>tool\n<tool_response>\n5\n</tool_response>\n<tool_response>\n5\n</tool_response>"
                     "<|im_end|><|im_start|>assistant\n")
    assert second.endswith("<tool_response>\n25\n</tool_response><|im_end|><|im_start|>assistant\n")
    assert first.endswith(generation_prompt(tok, ep.messages[:5], ep.tools))


@pytest.mark.parametrize("template,special,bos,eos,good,bad", [
    (QWEN3, CHATML_TOKENS, "<|bos|>", "<|im_end|>", SINGLE,
     '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call><|im_end|>'),
    (LLAMA3, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>",
     '{"name": "calculator", "parameters": {"expression": "5 * 5"}}<|eot_id|>',
     '{"name": "calculator", "parameters": {"expression": "5 * 5"}<|eot_id|>'),
    (MISTRAL, MISTRAL_TOKENS, "<s>", "</s>",
     '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "5 * 5"}}]</s>',
     '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "5 * 5"}</s>'),
])
def test_malformed_calls_are_error_observations_counted_and_rows_render(tiny_base, template, special, bos, eos,
                                                                      good, bad):
    tok = family_tokenizer(tiny_base, template, special, bos, eos)
    end = eos  # each family's model ends a turn with its EOS here
    ep, model, pieces, _ = run(tok, [bad, "The answer is 25" + end])
    (segment,) = appended_segments(tok, ep, model, pieces)
    assert "Error: tool call is not valid JSON" in segment and ep.info["malformed_calls"] == 1
    assert episode_metrics([ep])["tools/malformed_calls_per_episode"] == 1.0 and ep.score == -0.5
    best = run(tok, [good, "The answer is 25" + end])[0]
    worst = run(tok, ["The answer is 24" + end, "unused" + end])[0]
    row = json.loads(json.dumps(pair_to_row(best, worst, tok)))  # as written to and read from JSONL
    example = tokenize_row(row, tok, "row 1", max_length=1024, max_prompt_length=512)
    assert example.prompt_ids == best.prompt_ids
    written = tok.decode([t for t, m in zip(example.chosen_ids, example.chosen_mask) if m])
    assert "calculator" in written and "25" in written
    assert "25" in tok.decode([t for t, m in zip(example.chosen_ids, example.chosen_mask) if not m])


def test_a_template_that_drops_the_new_messages_is_named(tiny_base):
    tok = family_tokenizer(tiny_base, QWEN3.replace("'\n<tool_response>\n' + m.content", "'\n<tool_response>\n'"),
                           CHATML_TOKENS, "<|bos|>", "<|im_end|>")
    tok.name_or_path = "forgetful"
    with pytest.raises(TemplateDriftError, match=r"chat template of forgetful: message 2 \(tool\).*content of new"):
        run(tok, [SINGLE, "The answer is 25<|im_end|>"])


def test_llama3_and_mistral_parsers():
    calls, errors = parse_llama3_json_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1})] and not errors
    calls, errors = parse_llama3_json_tool_calls('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}')
    assert [c.name for c in calls] == ["f"] and errors == ["one tool call per turn: 'g' was not run"]
    assert parse_llama3_json_tool_calls("The answer is 4") == ([], [])
    assert parse_llama3_json_tool_calls('{"name": 3}')[1] == ["tool call needs a string 'name'"]
    calls, errors = parse_mistral_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": "{\\"x\\": 2}", "id": "abc"}]')
    assert calls[0].arguments == {"x": 2} and calls[0].id is None and not errors  # not 9 characters: made up later
    assert parse_mistral_tool_calls("[TOOL_CALLS][{")[1][0].startswith("tool call is not valid JSON")
    assert detect_tool_parser(MISTRAL) == "mistral" and detect_tool_parser(LLAMA3) == "llama3_json"
    assert detect_tool_parser(QWEN3) == "hermes" and detect_tool_parser({"tool_use": HERMES}) == "hermes"
