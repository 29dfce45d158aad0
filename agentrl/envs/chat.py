"""Conversations rendered by a tokenizer's own chat template, appended turn by turn without token drift.

Token-in-token-out needs each turn's ids to be the previous ids plus a new segment. Templates that
rewrite history (drop earlier reasoning, re-date the system prompt, ...) break that, so the check below
runs once per tokenizer and fails with one error naming the template instead of training on drifted ids.
"""

from __future__ import annotations

import re

_CHECKED: dict[int, str] = {}
_MARK = "AGENTRL_TURN_MARK"


class TemplateDriftError(ValueError):
    """The chat template is not prefix-preserving: a longer conversation re-renders earlier turns."""


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _template_name(tokenizer) -> str:
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"


def turn_end_marker(tokenizer, tools: list[dict] | None = None) -> str:
    """What the template writes right after an assistant message's content (`<|im_end|>`, `<|eot_id|>`):
    the token the model samples to end its turn."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": _MARK}]
    marked = _render(tokenizer, messages, tools, False)
    after = marked.split(_MARK, 1)[1] if _MARK in marked else ""
    turn_end = after.strip() or (tokenizer.eos_token or "")
    if not turn_end:
        raise TemplateDriftError(f"{_template_name(tokenizer)} marks no end of an assistant turn")
    return turn_end


class ChatRenderer:
    def __init__(self, tokenizer, tools: list[dict], turn_end: str):
        self.tokenizer, self.tools, self.turn_end = tokenizer, tools, turn_end
        self.messages: list[dict] = []
        self.text = ""

    @classmethod
    def for_tokenizer(cls, tokenizer, tools: list[dict]) -> "ChatRenderer":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"format 'chat' needs a tokenizer with a chat template; {_template_name(tokenizer)} is missing")
        key = id(tokenizer)
        if key not in _CHECKED:
            _CHECKED[key] = cls._check(tokenizer, tools)
        return cls(tokenizer, tools, _CHECKED[key])

    @staticmethod
    def _check(tokenizer, tools) -> str:
        """Probe the template once; return its end-of-turn marker (what follows an assistant message)."""
        user = [{"role": "user", "content": "What is 2 + 2?"}]
        turn_end = turn_end_marker(tokenizer, tools)
        call = '<tool_call>{"name": "probe", "arguments": {}}</tool_call>'
        short = _render(tokenizer, user, tools, True)
        long = _render(tokenizer, user + [{"role": "assistant", "content": call}, {"role": "tool", "content": "4"}],
                       tools, True)
        produced = short + call + turn_end
        if not long.startswith(produced):
            raise TemplateDriftError(f"{_template_name(tokenizer)} is not prefix-preserving: adding a turn re-renders "
                                     f"the earlier ones, so appended token ids would drift from what the model saw")
        ids = lambda text, special=True: tokenizer(text, add_special_tokens=special)["input_ids"]  # noqa: E731
        if ids(long) != ids(produced) + ids(long[len(produced):], False):
            raise TemplateDriftError(f"{_template_name(tokenizer)} renders turns whose tokens merge across the turn "
                                     f"boundary; appended token ids would drift")
        return turn_end

    @property
    def stop_pattern(self) -> str:
        return re.escape(self.turn_end)

    def start(self, messages: list[dict]) -> str:
        """The prompt: the conversation so far with the generation prompt."""
        self.messages = list(messages)
        self.text = _render(self.tokenizer, self.messages, self.tools, True)
        return self.text

    def content(self, sampled: str) -> str:
        """The assistant message in a turn's text as sampled (special tokens kept): before the turn end or EOS."""
        eos = self.tokenizer.eos_token
        text = sampled.split(self.turn_end, 1)[0]
        return text.split(eos, 1)[0] if eos else text

    def ended_with_eos(self, sampled: str) -> bool:
        """The model wrote EOS, and EOS is not this template's end of turn: the episode ends here."""
        eos = self.tokenizer.eos_token
        return bool(eos) and eos != self.turn_end and eos in sampled

    def tool_turn(self, sampled: str, results: list[str]) -> str:
        """Append the assistant turn and one `tool` message per result; return the text to append after
        what the model sampled (tool messages plus the next generation prompt).

        `sampled` is the turn's text with special tokens kept: when the model wrote the turn-end marker
        itself, the appended text starts after it; when the turn was cut by length, it starts with it.
        """
        produced = self.text + sampled
        self.messages.append({"role": "assistant", "content": self.content(sampled)})
        self.messages += [{"role": "tool", "content": r} for r in results]
        full = _render(self.tokenizer, self.messages, self.tools, True)
        if not full.startswith(produced):
            raise TemplateDriftError(f"{_template_name(self.tokenizer)} re-rendered earlier turns mid-episode")
        self.text = full
        return full[len(produced):]


def conversation_segments(tokenizer, prompt: list[dict], messages: list[dict],
                          tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """What the chat template adds for `messages` after `prompt` (rendered with its generation prompt), as
    (text, written by the policy) segments, for SFT and DPO data rendered exactly as a chat rollout sees it.

    As in a rollout, the policy writes an assistant message's content and the turn-end marker after it; the
    template's scaffolding (separators, tool messages, the generation prompt before each later assistant
    turn) is not the policy's. Renders growing prefixes; a template that rewrites earlier turns is an error.
    """
    def added(text: str, previous: str) -> str:
        if not text.startswith(previous):
            raise TemplateDriftError(f"{_template_name(tokenizer)} rewrites earlier turns; cannot mask by message")
        return text[len(previous):]

    turn_end, segments, history = turn_end_marker(tokenizer, tools), [], list(prompt)
    previous = _render(tokenizer, history, tools, True)
    for k, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        if assistant and k > 0:  # the generation prompt before a later assistant turn: scaffolding
            text = _render(tokenizer, history, tools, True)
            segments.append((added(text, previous), False))
            previous = text
        history.append(m)
        text = _render(tokenizer, history, tools, False)
        new, own = added(text, previous), (m.get("content") or "") + turn_end
        if assistant and new.startswith(own):  # what the policy writes; the separator after it is scaffolding
            segments += [(own, True), (new[len(own):], False)]
        else:  # tool messages; or a template that rewrites the content (trims it, renders tool calls, ...)
            segments.append((new, assistant))
        previous = text
    return segments


# A compact ChatML template with tool support for the embedded tiny model (tool names and arguments only,
# so prompts stay short).
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
