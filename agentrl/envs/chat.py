"""Conversations rendered by a tokenizer's own chat template, appended turn by turn without token drift.

Token-in-token-out does not need the template to be prefix-preserving, and most are not: Qwen3 drops or
adds `<think>` blocks in earlier turns, Mistral moves the system prompt and the tool list to the last user
message, Hermes' tool_use template ends the last tool message differently, Llama 3.2 stamps today's date.
So history is never re-rendered for training ids. The prompt is the template's rendering; after that, each
environment reply is the template's own text for the new messages only, appended right after the ids the
policy sampled:

    new text = render(history + [assistant as sampled] + new messages, generation prompt)
               after the end of that assistant turn (the turn-end marker that closes it)

The end of the assistant turn is found by rendering the same conversation once more with a marker in the
assistant message (its content and tool-call names), and the text after it must be the same in both
renderings and carry every new message's content; otherwise the error names the template and the message.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from dataclasses import dataclass

_MARK = "AGENTRL_TURN_MARK"
_MARK_END = "AGENTRL_CONTENT_END"
_EXTRA_TURN_ENDS = ("<|eom_id|>",)  # Llama 3.1 ends a `<|python_tag|>` call with it ("end of message")
_TURN_ENDS: dict[tuple, str] = {}


class TemplateDriftError(ValueError):
    """The chat template's text for new messages cannot be told apart from the turns before them."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool,
           template_kwargs: dict | None = None) -> str:
    """The template's text for `messages` (transformers' renderer: trim_blocks, its own tojson).

    For a template that drops `tools=` or assistant `tool_calls` (SmolLM2's, most base models'), the tools and
    calls are written as text first (`tools_as_text`), so rollouts, SFT rows and DPO rows all carry them."""
    if tools or any(m.get("tool_calls") for m in messages):
        support = template_tool_support(tokenizer, template_kwargs)
        if not (support.tools and support.calls):
            messages, tools = tools_as_text(messages, tools, support)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, **(template_kwargs or {}))


# --- templates that do not render tools --------------------------------------------------------------------

@dataclass(frozen=True)
class ToolSupport:
    tools: bool  # the template renders `tools=` (schemas appear in the prompt)
    calls: bool  # it renders an assistant message's structured `tool_calls`


_SUPPORT: dict[tuple, ToolSupport] = {}
_PROBE_TOOL = {"type": "function", "function": {"name": "agentrl_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def template_tool_support(tokenizer, template_kwargs: dict | None = None) -> ToolSupport:
    """Whether the chat template renders tool schemas and tool calls: render once with and once without a
    probe tool (and a probe call), and look for it. Cached per template; warns once when either is dropped."""
    key = (str(getattr(tokenizer, "chat_template", None)), repr(sorted((template_kwargs or {}).items())))
    if key in _SUPPORT:
        return _SUPPORT[key]
    kwargs = template_kwargs or {}

    def text(messages, tools=None):
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False,
                                                 **kwargs)
        except Exception:  # noqa: BLE001 - a template that refuses the probe is left to render as it does
            return None

    user = [{"role": "user", "content": "What is 2 + 2?"}]
    with_tools = text(user, [_PROBE_TOOL])
    tools = with_tools is None or "agentrl_probe_tool" in with_tools
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1B2c3D4e", "type": "function", "function": {"name": "agentrl_probe_call", "arguments": {}}}]}
    with_call = text(user + [call], [_PROBE_TOOL] if tools else None)
    calls = with_call is None or "agentrl_probe_call" in with_call
    _SUPPORT[key] = support = ToolSupport(tools, calls)
    if not (tools and calls):
        dropped = " and ".join(w for w, ok in (("tools=", tools), ("assistant tool_calls", calls)) if not ok)
        warnings.warn(f"{_template_name(tokenizer)} renders no {dropped}: agentrl writes "
                      f"{'the tool schemas and the Hermes call format into the system message and ' if not tools else ''}"
                      f"tool calls as <tool_call> JSON text in the assistant turn, the form the rollout parses",
                      stacklevel=3)
    return support


def tool_call_text(calls: list[dict]) -> str:
    """Structured tool calls as the Hermes text a model writes: `<tool_call>\n{"name", "arguments"}\n</tool_call>`."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"].get("arguments", {})})
                     + "\n</tool_call>" for c in calls)


def tools_system_text(tools: list[dict]) -> str:
    """The tool schemas and the Hermes call format, for a system message (compact: one JSON line a tool)."""
    # Without transformers' "return" entry (not part of a function-calling schema): fewer prompt tokens a row.
    schemas = "\n".join(json.dumps({k: v for k, v in t.get("function", t).items() if k != "return"}) for t in tools)
    return ("You can call these tools:\n<tools>\n" + schemas + "\n</tools>\nTo call a tool, write:\n<tool_call>\n"
            '{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>')


def tools_as_text(messages: list[dict], tools: list[dict] | None, support: ToolSupport) -> tuple[list[dict], list | None]:
    """(messages, tools) for a template that drops tools or calls: the schemas go into the system message
    (first, before any system text of the conversation), each assistant turn's calls become its text."""
    out = []
    for m in messages:
        if m.get("tool_calls") and not support.calls:
            content, calls = m.get("content") or "", tool_call_text(m["tool_calls"])
            m = {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": (content + "\n" if content else "") + calls}
        out.append(m)
    if tools and not support.tools:
        block = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": block + "\n\n" + (out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": block})
        tools = None
    return out, tools


def _template_name(tokenizer) -> str:
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"


def turn_end_marker(tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """What the template writes right after an assistant message's content (`<|im_end|>`, `<|eot_id|>`,
    `</s>`): the token the model samples to end its turn."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": _MARK}]
    marked = render(tokenizer, messages, tools, False, template_kwargs)
    after = marked.split(_MARK, 1)[1] if _MARK in marked else ""
    turn_end = after.strip() or (tokenizer.eos_token or "")
    if not turn_end:
        raise TemplateDriftError(f"{_template_name(tokenizer)} marks no end of an assistant turn")
    return turn_end


def _marked(message: dict) -> dict:
    """The assistant message with the marker in its content and its tool-call names: templates render one
    or the other (Llama and Mistral drop the content of a tool-call message)."""
    marked = copy.deepcopy(message)
    marked["content"] = _MARK
    for call in marked.get("tool_calls") or []:
        call["function"]["name"] = _MARK + call["function"]["name"]
    return marked


def appended_text(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None, turn_end: str,
                  template_kwargs: dict | None = None) -> str:
    """The template's text for `new` messages after `history`, whose last message is an assistant turn,
    followed by the generation prompt: what to append after the ids the policy sampled for that turn."""
    where = f"{_template_name(tokenizer)}: message {len(history)} ({', '.join(m['role'] for m in new)})"
    if not history or history[-1].get("role") != "assistant":
        raise TemplateDriftError(f"{where}: new messages must follow an assistant turn")
    try:
        full = render(tokenizer, history + new, tools, True, template_kwargs)
        marked = render(tokenizer, history[:-1] + [_marked(history[-1])] + new, tools, True, template_kwargs)
    except Exception as e:  # jinja's TemplateError and the templates' own raise_exception
        raise TemplateDriftError(f"{where}: the template refused the conversation: {e}") from e
    start = marked.rfind(_MARK)
    end = marked.find(turn_end, start) if start >= 0 else -1
    if end < 0:
        raise TemplateDriftError(f"{where}: cannot find where assistant message {len(history) - 1} ends (the "
                                 f"template renders neither its content nor its tool calls, or no {turn_end!r})")
    text = marked[end + len(turn_end):]
    if not full.endswith(text):
        raise TemplateDriftError(f"{where}: the text of the new messages depends on the assistant turn before "
                                 f"them; cannot append it without re-rendering history")
    position = 0
    for k, m in enumerate(new):  # each new message's content, in order, inside the appended text
        content = m.get("content")
        if isinstance(content, str) and content:  # as is, or as a JSON string (Llama 3's ipython turns)
            found = min((f for f in (text.find(content, position), text.find(json.dumps(content)[1:-1], position))
                         if f >= 0), default=-1)
            if found < 0:
                raise TemplateDriftError(f"{where}: the content of new message {len(history) + k} ({m['role']}) "
                                         f"is not in the text the template adds for it: {text!r}")
            position = found + len(content)
    return text


def assistant_text(tokenizer, history: list[dict], message: dict, tools: list[dict] | None, turn_end: str,
                   template_kwargs: dict | None = None) -> str:
    """The template's text for one assistant `message` after `history` (which ends with the generation
    prompt): what the policy writes for that turn, its turn-end marker included. For data written from
    messages (preference rows), where the turn is rendered from its structured form."""
    where = f"{_template_name(tokenizer)}: message {len(history)} (assistant)"
    try:
        full = render(tokenizer, history + [message], tools, False, template_kwargs)
        marked = render(tokenizer, history + [_marked(message)], tools, False, template_kwargs)
        prompt = render(tokenizer, history, tools, True, template_kwargs)
        plain = render(tokenizer, history, tools, False, template_kwargs)
    except Exception as e:  # jinja's TemplateError and the templates' own raise_exception
        raise TemplateDriftError(f"{where}: the template refused the conversation: {e}") from e
    start = marked.rfind(_MARK)
    end = marked.find(turn_end, start) if start >= 0 else -1
    if end < 0:
        raise TemplateDriftError(f"{where}: cannot find where the assistant turn ends")
    tail = len(marked) - end - len(turn_end)  # what the template writes after the turn end
    if full[len(full) - tail:] != marked[len(marked) - tail:]:
        raise TemplateDriftError(f"{where}: the text after the turn depends on its content")
    end = len(full) - tail
    begin = len(prompt) if full.startswith(prompt) else _turn_start(tokenizer, history, message, tools,
                                                                      template_kwargs, full, marked, prompt, plain)
    if begin < 0:
        raise TemplateDriftError(f"{where}: cannot find where the assistant turn starts")
    return full[begin:end]


def _turn_start(tokenizer, history, message, tools, template_kwargs, full, marked, prompt, plain) -> int:
    """Where an assistant turn starts in `full` when the template re-renders the end of history once a turn
    follows (Mistral drops the system prompt from the last user message, Hermes' tool_use template ends the
    last tool message differently). -1 when it cannot be told."""
    last = history[-1]
    if isinstance(last.get("content"), str):
        # 1. Mark the end of the previous message's content: the turn starts after what the template writes
        # between that mark and the generation prompt's end, if it writes the same with the turn after it.
        ended = history[:-1] + [dict(last, content=last["content"] + _MARK_END)]
        prompt_marked = render(tokenizer, ended, tools, True, template_kwargs)
        full_marked = render(tokenizer, ended + [message], tools, False, template_kwargs)
        if prompt_marked.count(_MARK_END) == 1 and full_marked.count(_MARK_END) == 1:
            closing = prompt_marked.split(_MARK_END, 1)[1]
            after = full_marked.index(_MARK_END) + len(_MARK_END)
            if full_marked.startswith(closing, after):  # same text after the mark: count from the end
                return len(full) - (len(full_marked) - after - len(closing))
    # 2. The turn starts after the last generation prompt before the first character the marker changed.
    generation_prompt = prompt[len(plain):] if prompt.startswith(plain) else ""
    same = next((i for i, (a, b) in enumerate(zip(full, marked)) if a != b), min(len(full), len(marked)))
    found = full.rfind(generation_prompt, 0, same) if generation_prompt else -1
    return found + len(generation_prompt) if found >= 0 else -1


class ChatRenderer:
    """One conversation: the prompt as the template renders it, then the text to append after each turn."""

    def __init__(self, tokenizer, tools: list[dict], turn_end: str, template_kwargs: dict | None = None):
        self.tokenizer, self.tools, self.turn_end = tokenizer, tools, turn_end
        self.template_kwargs = dict(template_kwargs or {})
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        special |= set(getattr(tokenizer, "added_tokens_encoder", {}))
        self.turn_ends = (turn_end,) + tuple(t for t in _EXTRA_TURN_ENDS if t in special and t != turn_end)
        self.messages: list[dict] = []

    @classmethod
    def for_tokenizer(cls, tokenizer, tools: list[dict], template_kwargs: dict | None = None) -> "ChatRenderer":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"format 'chat' needs a tokenizer with a chat template; {_template_name(tokenizer)} is missing")
        # One probe per tokenizer and template arguments, not per episode (environments are made per episode).
        key = (id(tokenizer), str(tokenizer.chat_template), repr(sorted((template_kwargs or {}).items())))
        if key not in _TURN_ENDS:
            _TURN_ENDS[key] = turn_end_marker(tokenizer, tools, template_kwargs)
        return cls(tokenizer, tools, _TURN_ENDS[key], template_kwargs)

    @property
    def stop_pattern(self) -> str:
        return "|".join(re.escape(t) for t in self.turn_ends)

    def start(self, messages: list[dict]) -> str:
        """The prompt: the conversation so far with the generation prompt."""
        self.messages = list(messages)
        return render(self.tokenizer, self.messages, self.tools, True, self.template_kwargs)

    def content(self, sampled: str) -> str:
        """The assistant message in a turn's text as sampled (special tokens kept): before the turn end or EOS."""
        eos = self.tokenizer.eos_token
        for marker in self.turn_ends + ((eos,) if eos else ()):
            sampled = sampled.split(marker, 1)[0]
        return sampled

    def ended_with_eos(self, sampled: str) -> bool:
        """The model wrote EOS, and EOS is not this template's end of turn: the episode ends here."""
        eos = self.tokenizer.eos_token
        return bool(eos) and eos not in self.turn_ends and eos in sampled

    def tool_turn(self, sampled: str, assistant: dict, results: list[dict]) -> str:
        """Append the assistant turn and its tool messages (all results of the turn, in one rendering);
        return the text to append after what the model sampled: the tool messages and the next generation
        prompt, as the template writes them.

        `sampled` is the turn's text with special tokens kept: when the model wrote its turn-end marker,
        the appended text starts after it; when the turn was cut by length, it starts with the marker.
        """
        self.messages.append(assistant)
        text = appended_text(self.tokenizer, self.messages, results, self.tools, self.turn_end, self.template_kwargs)
        self.messages += results
        ended = any(marker in sampled for marker in self.turn_ends)
        return text if ended else self.turn_end + text


def conversation_segments(tokenizer, prompt: list[dict], messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[tuple[str, bool]]:
    """`messages` after `prompt` (rendered with its generation prompt) as (text, written by the policy)
    segments, exactly as a chat rollout builds them, for SFT and DPO rows written as messages: each assistant
    turn as the template renders it, through its turn-end marker (True); the template's own text for the
    messages between assistant turns, up to the next generation prompt (False). History is never re-rendered,
    so templates that rewrite earlier turns (Qwen3, Mistral, Hermes' tool_use) work too."""
    turn_end, segments, history = turn_end_marker(tokenizer, tools, template_kwargs), [], list(prompt)
    k = 0
    while k < len(messages):
        if messages[k]["role"] == "assistant":
            segments.append((assistant_text(tokenizer, history, messages[k], tools, turn_end, template_kwargs), True))
            history.append(messages[k])
            k += 1
            if k < len(messages) and messages[k]["role"] == "assistant":  # two turns in a row
                segments.append((appended_text(tokenizer, history, [], tools, turn_end, template_kwargs), False))
            continue
        run = [messages[k]]
        while k + len(run) < len(messages) and messages[k + len(run)]["role"] != "assistant":
            run.append(messages[k + len(run)])
        if not history or history[-1]["role"] != "assistant":
            raise TemplateDriftError(f"message {k} ({run[0]['role']}) must follow an assistant message")
        segments.append((appended_text(tokenizer, history, run, tools, turn_end, template_kwargs), False))
        history += run
        k += len(run)
    return segments


# A compact ChatML template with tool support for the embedded tiny model (tool names and arguments only,
# so prompts stay short). Tool calls render as the Hermes JSON the model writes.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
