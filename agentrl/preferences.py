"""Preference data: reading {prompt, chosen, rejected} rows, tokenizing them with an assistant-only mask,
and building pairs from environment rollouts.

Only tokens the assistant produced count in DPO's sequence logprobs: tool / observation text inside a
trajectory is masked out (TRL's DPO scores it as if the model had written it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import UserError
from agentrl.rollout.engine import Episode, encode_prompt


class PreferenceDataError(UserError):
    """A malformed preference row; the message names the file, the row and the field."""


@dataclass
class PreferenceExample:
    """Token ids after the prompt; masks are 1 on assistant tokens, 0 on tool/observation tokens."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None


DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".yaml", ".yml")


def read_preference_rows(source) -> tuple[list[dict], str]:
    """Rows from a JSONL file, a `datasets` directory (save_to_disk), a Dataset/list, or a `datasets` name."""
    if isinstance(source, (list, tuple)):
        return list(source), "<list>"
    if hasattr(source, "column_names"):  # a datasets.Dataset
        return [dict(r) for r in source], "<dataset>"
    path = Path(str(source))
    if path.suffix == ".jsonl" or path.is_file():
        from agentrl.data import read_jsonl

        return read_jsonl(path), str(path)
    if not path.exists() and (path.is_absolute() or str(source).startswith((".", "~"))
                              or path.suffix.lower() in DATA_FILE_SUFFIXES):
        # A path, not a hub name: `datasets` would spend ~30 s asking the hub before it failed.
        raise PreferenceDataError(f"{source}: no such file")
    import datasets

    try:
        ds = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.load_dataset(str(source), split="train")
    except Exception as e:  # noqa: BLE001 - a typo in a path must not read as a hub error (or a traceback)
        raise PreferenceDataError(f"{source}: no such file, and not a dataset that `datasets` can load "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:400]) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    return [dict(r) for r in ds], str(source)


def _check_messages(messages: list, field: str, where: str, calls_without_content: bool) -> None:
    """Every message a dict with a string 'role' and 'content' (content None allowed for a turn of tool calls)."""
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (isinstance(m.get("content"), str) or (
                calls_without_content and m.get("content") is None and m.get("tool_calls"))):
            raise PreferenceDataError(f"{where}: field {field!r} message {k} needs string 'role' and 'content'")


def _segments(value, field: str, where: str, tokenizer, prompt_messages: list | None,
              tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[tuple[str, bool]]:
    """A completion as (text, is_assistant) segments. Strings are one assistant segment."""
    if isinstance(value, str):
        if not value.strip():
            raise PreferenceDataError(f"{where}: field {field!r} is empty")
        return [(value, True)]
    if not isinstance(value, list) or not value:
        raise PreferenceDataError(f"{where}: field {field!r} must be a non-empty string or list of messages")
    _check_messages(value, field, where, calls_without_content=True)
    if not any(m["role"] == "assistant" and ((m["content"] or "").strip() or m.get("tool_calls")) for m in value):
        raise PreferenceDataError(f"{where}: field {field!r} has no assistant message")
    if _templated(tokenizer, prompt_messages):
        # As in a chat rollout, the mask is 1 on what the policy writes (an assistant turn as the template
        # renders it, through its turn-end marker) and 0 on the template's text for the messages between.
        from agentrl.envs.chat import TemplateDriftError, conversation_segments

        try:
            return conversation_segments(tokenizer, prompt_messages, value, tools, template_kwargs)
        except TemplateDriftError as e:
            raise PreferenceDataError(f"{where}: field {field!r}: {e}") from e
    # No chat template: the trajectory is ReAct text, roles implicit; concatenate the contents.
    return [(m["content"] or "", m["role"] == "assistant") for m in value]


def _templated(tokenizer, prompt_messages: list | None) -> bool:
    """Rows whose prompt is a message list are rendered with the tokenizer's chat template, when it has one."""
    return bool(getattr(tokenizer, "chat_template", None)) and prompt_messages is not None


def tokenize_row(row: dict, tokenizer, where: str, max_length: int, max_prompt_length: int) -> PreferenceExample:
    for field in ("prompt", "chosen", "rejected"):
        if field not in row:
            raise PreferenceDataError(f"{where}: missing field {field!r}")
    prompt, tools, template_kwargs = row["prompt"], row.get("tools"), row.get("chat_template_kwargs")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise PreferenceDataError(f"{where}: field 'tools' must be a list of tool schemas (objects)")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise PreferenceDataError(f"{where}: field 'chat_template_kwargs' must be an object")
    prompt_messages = None
    if isinstance(prompt, list):
        if not prompt:
            raise PreferenceDataError(f"{where}: field 'prompt' is an empty list of messages")
        _check_messages(prompt, "prompt", where, calls_without_content=False)
        prompt_messages = prompt
        if getattr(tokenizer, "chat_template", None):
            from agentrl.envs.chat import render

            text = render(tokenizer, prompt, tools, True, template_kwargs)  # as the rollout renders it
            prompt_ids = encode_prompt(tokenizer, text)  # the ids the rollout engine gives the same prompt
        else:
            prompt_ids = tokenizer("".join(m.get("content", "") for m in prompt))["input_ids"]
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise PreferenceDataError(f"{where}: field 'prompt' is empty")
        prompt_ids = tokenizer(prompt)["input_ids"]
    else:
        raise PreferenceDataError(f"{where}: field 'prompt' must be a string or a list of messages, "
                                  f"got {type(prompt).__name__}")
    if len(prompt_ids) > max_prompt_length:
        raise PreferenceDataError(f"{where}: field 'prompt' is {len(prompt_ids)} tokens, over max_prompt_length="
                                  f"{max_prompt_length}")
    budget = max_length - len(prompt_ids)
    out = []
    for field in ("chosen", "rejected"):
        segments = _segments(row[field], field, where, tokenizer, prompt_messages, tools, template_kwargs)
        pieces = tokenizer([t for t, _ in segments], add_special_tokens=False)["input_ids"]
        ids, mask = [], []
        for piece, (_, assistant) in zip(pieces, segments):
            ids += piece
            mask += [int(assistant)] * len(piece)
        # A templated completion ends with the turn-end marker the policy samples; anything else ends with EOS.
        templated = _templated(tokenizer, prompt_messages) and isinstance(row[field], list)
        if not templated and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids.append(tokenizer.eos_token_id)
            mask.append(1)
        ids, mask = ids[:budget], mask[:budget]  # truncate the completion, never the prompt
        if not any(mask):
            raise PreferenceDataError(f"{where}: field {field!r} has no assistant token within max_length={max_length}")
        out += [ids, mask]
    return PreferenceExample(prompt_ids, *out)


def load_preferences(source, tokenizer, max_length: int = 512, max_prompt_length: int = 256,
                     skip_bad_rows: bool = False) -> tuple[list[PreferenceExample], int]:
    """Tokenized examples and the number of rows skipped (only when `skip_bad_rows`; else the first bad
    row raises PreferenceDataError naming file, row and field)."""
    rows, name = read_preference_rows(source)
    examples, skipped = [], 0
    for i, row in enumerate(rows, start=1):
        where = f"{name}: row {i}"
        try:
            if not isinstance(row, dict):
                raise PreferenceDataError(f"{where}: expected an object with prompt/chosen/rejected")
            examples.append(tokenize_row(row, tokenizer, where, max_length, max_prompt_length))
        except PreferenceDataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if not examples:
        raise PreferenceDataError(f"{name}: no usable preference rows ({skipped} skipped)")
    return examples, skipped


# --- pairs from an environment --------------------------------------------------------------------------

def episode_messages(ep: Episode, tokenizer) -> list[dict]:
    """The trajectory after the prompt as messages: runs of sampled tokens are 'assistant', the rest 'tool'."""
    messages, start = [], 0
    for j in range(1, len(ep.token_ids) + 1):
        if j == len(ep.token_ids) or ep.loss_mask[j] != ep.loss_mask[start]:
            role = "assistant" if ep.loss_mask[start] else "tool"
            messages.append({"role": role, "content": tokenizer.decode(ep.token_ids[start:j], skip_special_tokens=True)})
            start = j
    return messages


def build_pairs(episodes: list[Episode], group_size: int) -> tuple[list[tuple[Episode, Episode]], int]:
    """Consecutive groups of `group_size` episodes of one task -> (best, worst) pairs and the number of
    groups skipped because every score was equal (a group of one is always such a tie). Episodes that failed
    outside the policy (infra_failure: a dead tool server, a judge's malformed verdict) take no part."""
    if group_size < 1 or len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes do not split into groups of {group_size}")
    pairs, ties = [], 0
    for start in range(0, len(episodes), group_size):
        group = [ep for ep in episodes[start:start + group_size] if not ep.infra_failure]
        if not group:
            ties += 1
            continue
        best = max(group, key=lambda e: e.score)
        worst = min(group, key=lambda e: e.score)
        if best.score == worst.score:
            ties += 1
            continue
        pairs.append((best, worst))
    return pairs, ties


def pair_to_example(best: Episode, worst: Episode) -> PreferenceExample:
    """Token-in-token-out: the exact sampled ids, with their masks, no re-tokenization."""
    return PreferenceExample(best.prompt_ids, best.token_ids, best.loss_mask, worst.token_ids, worst.loss_mask)


def pair_to_row(best: Episode, worst: Episode, tokenizer) -> dict:
    """A JSONL row. Chat episodes keep their messages and tool schemas, so the tokenizer's template renders
    the row as the policy saw it; other episodes are ReAct text split into assistant and tool runs."""
    scores = {"chosen_score": best.score, "rejected_score": worst.score}
    if best.messages is not None and worst.messages is not None:
        n = next(i for i, m in enumerate(best.messages) if m["role"] == "assistant")  # system + user prompt
        row = {"prompt": best.messages[:n], "chosen": best.messages[n:], "rejected": worst.messages[n:]}
        kwargs = {"chat_template_kwargs": best.chat_template_kwargs} if best.chat_template_kwargs else {}
        return {**row, **({"tools": best.tools} if best.tools else {}), **kwargs, **scores}
    return {"prompt": tokenizer.decode(best.prompt_ids, skip_special_tokens=True),
            "chosen": episode_messages(best, tokenizer), "rejected": episode_messages(worst, tokenizer), **scores}

