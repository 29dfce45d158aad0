"""Supervised fine-tuning on demonstrations: SFTConfig / SFTTrainer (the first step of SFT -> RL).

A demonstration row is one of
    {"segments": [[text, trainable], ...]}        text pieces split where the rollout engine splits turns:
                                                  the prompt and tool observations not trainable
    {"messages": [...], "tools": [...]}           a chat: only what the assistant writes is trained
(a bare list of [text, trainable] pairs reads as segments). Segments are tokenized one by one after BOS and
end with EOS, exactly as a ReAct rollout's ids are built; chat rows are rendered with the tokenizer's chat
template by the same code that renders chat rollouts and DPO rows (envs/chat.py), so tool messages and the
template's scaffolding are masked. Without a chat template, messages read as ReAct text (contents in order).
The loss is the causal LM's mean cross-entropy over trainable tokens; LoRA or full fine-tuning alike.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from agentrl.errors import UserError
from agentrl.precision import resolve_mixed_precision
from agentrl.trainers.common import MetricsLog, default_pad_token, finite_or_raise, progress_bar

Example = tuple[list[int], list[int]]  # (token ids, labels): labels are the ids on trainable tokens, -100 elsewhere


class DemonstrationDataError(UserError):
    """A malformed demonstration row; the message names the file and line (or the row) and the field."""


@dataclass
class SFTConfig:
    """The defaults train the embedded tiny model from scratch (a few minutes on a laptop CPU); for a
    pretrained model use a learning rate near 1e-4 (LoRA) or 1e-5 (full fine-tuning) and fewer steps."""

    data: str | None = None  # demonstrations JSONL for `agentrl sft`; None: the environment's (env.demonstrations)
    steps: int = 600  # optimizer steps; the data is cycled (reshuffled each pass) as often as needed
    batch_size: int = 64  # demonstrations per step
    learning_rate: float = 3e-3  # AdamW learning rate (cosine decay after warmup)
    warmup_steps: int = 50  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float | None = 1.0  # gradient-norm clip (None: off)
    max_length: int = 1024  # tokens; longer demonstrations are cut (and counted in truncated_rows)
    shuffle: bool = True  # reshuffle the demonstrations each pass; False: in order
    share_prefix: bool = False  # rows that begin alike (a system message, tool schemas) run those tokens once a
    # batch (shared_prefix_loss): the same loss up to float rounding, at real vocabulary sizes (the sparse-logits path)
    group_by_length: bool = False  # batches of rows of similar length (less padding), drawn in a shuffled order
    # (in order of length within each window of 8 batches when not `shuffle`). Where length tells the rows'
    # behaviour apart (a tool call adds a turn), each batch then holds one behaviour: see DemonstrationBatches
    skip_bad_rows: bool = False  # skip and count malformed rows instead of stopping at the first
    logging_steps: int = 20  # a metrics row every this many steps
    seed: int = 0  # shuffling (and, in jobs, the demonstrations' draw)
    mixed_precision: Literal["no", "bf16", "auto"] = "no"  # bf16 autocast of the forward (x1.5-1.8 on CPUs with
    # AVX512-BF16, many times slower where emulated); auto: bf16 where native (agentrl/precision.py)
    replay_fraction: float = 0.0  # `agentrl sft` on a pretrained model: this share of the rows are the model's own
    # greedy answers to general instructions (jobs/retention.REPLAY_PROMPTS), so it keeps what it knew; 0: off
    min_demo_exact_match: float = 0.9  # the embedded builder (jobs/base_model.py) trains on past `steps`, in
    # rounds of `steps`, while fewer of the demonstrations than this are reproduced (demo_exact_match); 0: off
    max_steps: int | None = None  # the bound on those rounds, in steps (None: 4 x steps); reached, it warns
    progress: bool = True  # progress bar

    def __post_init__(self):
        for name in ("steps", "batch_size", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_demo_exact_match <= 1.0:  # NaN fails too
            raise ValueError(f"min_demo_exact_match must be in [0, 1], got {self.min_demo_exact_match}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or None: 4 x steps), got {self.max_steps}")
        if not 0.0 <= self.replay_fraction < 1.0:
            raise ValueError(f"replay_fraction must be in [0, 1), got {self.replay_fraction}")


# --- rows -> token ids and labels ------------------------------------------------------------------------

def _segments_of(value, where: str) -> list[tuple[str, bool]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DemonstrationDataError(f"{where}: field 'segments' must be a non-empty list of [text, trainable]")
    out = []
    for k, item in enumerate(value):
        if isinstance(item, dict):
            item = (item.get("text"), item.get("trainable"))
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], bool)):
            raise DemonstrationDataError(f"{where}: field 'segments' item {k} must be [text, trainable] "
                                         f"(a string and true/false), got {item!r}"[:300])
        out.append((item[0], item[1]))
    if not any(trainable and text for text, trainable in out):
        raise DemonstrationDataError(f"{where}: field 'segments' has no trainable text")
    return out


def _tool_call(call, where: str) -> dict:
    """A tool call in the shape chat templates render: {"type": "function", "function": {name, arguments}}."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DemonstrationDataError(f"{where}: 'tool_calls' needs objects with a string 'name' "
                                     f"(or 'function': {{'name': ...}})")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise DemonstrationDataError(f"{where}: tool call {fn['name']!r}: 'arguments' is not JSON") from None
    return {**{k: v for k, v in call.items() if k != "function"}, "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def _messages_of(row: dict, where: str) -> tuple[list[dict], list[dict] | None]:
    messages, tools = row["messages"], row.get("tools")
    if not isinstance(messages, list) or not messages:
        raise DemonstrationDataError(f"{where}: field 'messages' must be a non-empty list of messages")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DemonstrationDataError(f"{where}: field 'tools' must be a list of tool schemas (objects)")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DemonstrationDataError(f"{where}: field 'messages' item {k} needs a string 'role'")
        content, calls = m.get("content"), m.get("tool_calls")
        if not isinstance(content, str) and not (content is None and calls):
            raise DemonstrationDataError(f"{where}: field 'messages' item {k} needs a string 'content'")
        message = {**m, "content": content or ""}
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise DemonstrationDataError(f"{where}: field 'messages' item {k}: 'tool_calls' must be a list "
                                             f"on an assistant message")
            message["tool_calls"] = [_tool_call(c, f"{where}: field 'messages' item {k}") for c in calls]
        out.append(message)
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in out):
        raise DemonstrationDataError(f"{where}: field 'messages' has no assistant message")
    return out, tools


def _hermes(message: dict) -> str:
    """An assistant message as ReAct-style text: its content, then its calls as Hermes blocks."""
    return message["content"] + "".join(
        f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}</tool_call>"
        for c in message.get("tool_calls") or [])


def demonstration_segments(row, tokenizer, where: str) -> tuple[str, list[tuple[str, bool]], bool]:
    """(prompt text, (text, trainable) segments after it, whether the row ends with EOS) of one row."""
    if isinstance(row, (list, tuple)):
        row = {"segments": row}
    if not isinstance(row, dict) or ("segments" in row) == ("messages" in row):
        raise DemonstrationDataError(f"{where}: expected an object with a 'segments' or a 'messages' field")
    if "segments" in row:
        return "", _segments_of(row["segments"], where), True
    messages, tools = _messages_of(row, where)
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise DemonstrationDataError(f"{where}: field 'chat_template_kwargs' must be an object")
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, rest = messages[:first], messages[first:]
    if getattr(tokenizer, "chat_template", None):
        from agentrl.envs.chat import TemplateDriftError, conversation_segments, render

        try:
            # A templated conversation ends with the turn-end marker the policy samples, not with EOS.
            return (render(tokenizer, prompt, tools, True, kwargs),
                    conversation_segments(tokenizer, prompt, rest, tools, kwargs), False)
        except TemplateDriftError as e:
            raise DemonstrationDataError(f"{where}: field 'messages': {e}") from None
    # No chat template: ReAct text, roles implicit.
    return ("".join(m["content"] for m in prompt),
            [(_hermes(m), True) if m["role"] == "assistant" else (m["content"], False) for m in rest], True)


def encode_demonstrations(rows: list[tuple[str, object]], tokenizer, max_length: int | None = None,
                          skip_bad_rows: bool = False) -> tuple[list[Example], int, int]:
    """(examples, rows skipped, rows cut at max_length) of (where, row) pairs. The token ids are built as the
    rollout engine builds them: the prompt with its BOS (encode_prompt), then each segment on its own."""
    from agentrl.rollout.engine import encode_prompt

    parsed, skipped = [], 0
    for where, row in rows:
        try:
            if isinstance(row, UserError):  # a line that was not JSON
                raise DemonstrationDataError(str(row))
            parsed.append((where, *demonstration_segments(row, tokenizer, where)))
        except DemonstrationDataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    # One batched tokenizer call over every piece (fast, in Rust); prompts separately, with their BOS.
    prompts = [encode_prompt(tokenizer, p) if p else ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None
                                                      else []) for _, p, _, _ in parsed]
    texts = [text for _, _, segments, _ in parsed for text, _ in segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    eos = tokenizer.eos_token_id
    examples, cut = [], 0
    for prompt_ids, (where, _, segments, ends_with_eos) in zip(prompts, parsed):
        ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
        for _text, trainable in segments:
            piece = next(pieces)
            ids += piece
            labels += piece if trainable else [-100] * len(piece)
        if ends_with_eos and eos is not None:  # the policy ends its episode with EOS
            ids, labels = ids + [eos], labels + [eos]
        if max_length is not None and len(ids) > max_length:
            ids, labels, cut = ids[:max_length], labels[:max_length], cut + 1
        if all(label == -100 for label in labels[1:]):
            if not skip_bad_rows:
                raise DemonstrationDataError(f"{where}: no trainable token within max_length={max_length}")
            skipped += 1
            continue
        examples.append((ids, labels))
    return examples, skipped, cut


def read_demonstrations(source, name: str | None = None) -> list[tuple[str, object]]:
    """(where, row) pairs from a JSONL file ("file:line"), a `datasets` Dataset, or a list of rows."""
    if isinstance(source, (str, Path)):
        from agentrl.data import jsonl_rows

        return jsonl_rows(source)
    if hasattr(source, "column_names"):  # a datasets.Dataset
        source = [dict(r) for r in source]
    if not isinstance(source, (list, tuple)):
        raise TypeError(f"demonstrations must be a JSONL path, a Dataset or a list of rows, got {type(source).__name__}")
    return [(f"{name or '<list>'}: row {i}", row) for i, row in enumerate(source, start=1)]


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) input_ids, labels (-100 on padding and untrained tokens) and attention_mask."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


# From this vocabulary size on, SFT computes logits only at positions some row trains on. At SmolLM2's 49 K the
# head is about a fifth of a forward over every position; at the embedded model's ~300 tokens it is nothing,
# and the full-logits path keeps its seeded runs' numbers exactly as they were.
SPARSE_LOGITS_MIN_VOCAB = 32768


def sft_loss(model, batch: dict[str, torch.Tensor], share_prefix: bool = False) -> torch.Tensor:
    """The causal LM's mean cross-entropy over the trainable tokens of a collated batch.

    share_prefix: rows that begin with the same tokens run them once (shared_prefix_loss); the same loss up to
    float rounding."""
    from agentrl.rollout.sampling import index_logits_to_keep

    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    if vocab < SPARSE_LOGITS_MIN_VOCAB or not index_logits_to_keep(model, device):
        return model(**batch).loss
    loss = shared_prefix_loss(model, batch) if share_prefix else None
    if loss is not None:
        return loss
    targets = batch["labels"][:, 1:]  # (B, T-1): the token each position predicts, -100 where not trained
    keep = (targets != -100).any(0).nonzero().squeeze(1)  # (K,) positions any row trains on
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[:, keep].flatten(), ignore_index=-100)


def shared_prefix_loss(model, batch: dict[str, torch.Tensor], paths=None) -> torch.Tensor | None:
    """sft_loss with each group of rows that share a prefix (prefix_groups: an agent's demonstrations share the
    system message and the tool schemas, most of each row) running that prefix once, as a batch of one whose KV
    cache every row of the group continues (common_prefix_logprobs; gradients reach the prefix through the cache),
    the rests in groups by length where they differ (a demonstration that calls a tool is longer than one that
    answers at once). Rows that share nothing worth it run as one more batch. None where the model cannot take
    this path (gradient checkpointing keeps no cache; a head that cannot be split off): then the plain forward.
    paths: the rest groups' settings (a LogprobPaths; None: the default)."""
    from agentrl.trainers.common import FAST, TokenBatch, common_prefix_logprobs, prefix_groups, response_logprobs

    paths = paths or FAST

    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5 (is_gradient_... before)
    if checkpointing if checkpointing is not None else getattr(model, "is_gradient_checkpointing", False):
        return None
    trained = (batch["labels"][:, 1:] != -100).float()  # (B, T-1): position t predicts a trained token t+1
    tokens = TokenBatch(batch["input_ids"], batch["attention_mask"], trained, torch.zeros_like(trained))
    summed, alone = [], []  # summed: each part's total logprob of its trained tokens
    for rows, prefix in prefix_groups(tokens):
        part = tokens.select(rows)
        out = (common_prefix_logprobs(model, part, 1.0, min_saving=0.0, rest_min_saving=paths.rest_min_saving,
                                      rest_buckets=paths.rest_buckets) if prefix >= 2 else None)
        if out is None:
            alone.append(rows)
        else:
            summed.append((out[0] * part.loss_mask).sum())
    if alone:
        part = tokens.select(torch.cat(alone))
        out = response_logprobs(model, part, 1.0)
        if out is None:
            return None
        summed.append((out[0] * part.loss_mask).sum())
    return -torch.stack(summed).sum() / trained.sum().clamp(min=1)


class DemonstrationBatches:
    """Endless batches of encoded demonstrations in reshuffled passes (in order when not `shuffle`).

    group_by_length: after its first batch, each pass is cut into windows of GROUP_WINDOW batches; a window's rows
    are sorted by length and cut into batches, which are then drawn in random order (in order when not `shuffle`).
    Padding falls to the spread of lengths within a batch (transformers' group_by_length does the same with its
    LengthGroupedSampler). The price: a batch is no longer a sample of the data. Where the rows' length follows what
    they teach (demonstrations that call a tool are longer than those that answer at once), every batch teaches one
    behaviour, the gradient swings between them, and the last batches decide what the model keeps; measured on the
    real-model SFT job, it left a much weaker model (docs/real-model.md)."""

    GROUP_WINDOW = 8

    def __init__(self, examples: list[Example], batch_size: int, pad_id: int, seed: int = 0, shuffle: bool = True,
                 group_by_length: bool = False):
        if not examples:
            raise ValueError("no demonstrations to draw batches from")
        self.examples, self.batch_size, self.pad_id, self.shuffle = examples, batch_size, pad_id, shuffle
        self.group_by_length = group_by_length
        self.rng, self.order = random.Random(seed), []

    def next(self) -> dict[str, torch.Tensor]:
        chunk = []
        while len(chunk) < self.batch_size:
            if not self.order:
                self.order = list(range(len(self.examples)))
                if self.shuffle:
                    self.rng.shuffle(self.order)
                if self.group_by_length:  # the pass's first batch (or the rest of the one in progress) takes
                    self.order = self._grouped(self.order, self.batch_size - len(chunk))  # its rows as they come
                self.order.reverse()  # pop() from the end walks the pass front to back
            chunk.append(self.examples[self.order.pop()])
        return collate(chunk, self.pad_id)

    def _grouped(self, order: list[int], head: int) -> list[int]:
        size, out = self.batch_size, order[:head]
        for start in range(head, len(order), self.GROUP_WINDOW * size):
            window = sorted(order[start:start + self.GROUP_WINDOW * size], key=lambda i: len(self.examples[i][0]))
            batches = [window[k:k + size] for k in range(0, len(window), size)]
            tail = batches.pop() if len(batches[-1]) < size else []  # a short last batch stays last: the
            if self.shuffle:  # next pass's rows complete it
                self.rng.shuffle(batches)
            out += [i for batch in batches for i in batch] + tail
        return out


class SFTTrainer:
    """SFTTrainer(model, args=SFTConfig(...), train_dataset=rows or "demos.jsonl", tokenizer=tokenizer).train()

    `model` is any causal LM (a PEFT model trains its adapter only). `save_model` merges a LoRA adapter and
    writes a plain model directory with its tokenizer, which every agentrl job loads as `model.base`.
    """

    def __init__(self, model, args: SFTConfig | None = None, train_dataset=None, tokenizer=None,
                 dataset_name: str | None = None):
        self.config = args = args or SFTConfig()
        if tokenizer is None or train_dataset is None:
            raise ValueError("SFTTrainer needs `train_dataset` and `tokenizer`")
        default_pad_token(tokenizer)  # labels are -100 on padding
        self.model, self.tokenizer = model, tokenizer
        rows = read_demonstrations(train_dataset, dataset_name)
        self.examples, self.skipped_rows, self.truncated_rows = encode_demonstrations(
            rows, tokenizer, args.max_length, args.skip_bad_rows)
        if not self.examples:
            raise DemonstrationDataError(f"{dataset_name or train_dataset}: no usable demonstrations "
                                         f"({self.skipped_rows} skipped)")
        self.history: list[dict] = []
        self.steps_done = 0
        self._optimizer = self._batches = self._log = None

    def train(self, metrics_path: str | None = None, steps: int | None = None) -> list[dict]:
        """`steps` (default: the config's) AdamW steps on batches of demonstrations; returns the logged rows.

        Called again, it trains `steps` more: a fresh warmup and cosine cycle (a warm restart, Loshchilov & Hutter
        2017, arXiv:1608.03983) with the same optimizer, the batches and the metrics rows going on where they stopped.
        """
        from transformers import get_cosine_schedule_with_warmup

        cfg, model, steps = self.config, self.model, steps or self.config.steps
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
            self._batches = DemonstrationBatches(self.examples, cfg.batch_size, self.tokenizer.pad_token_id, cfg.seed,
                                                 cfg.shuffle, cfg.group_by_length)
            self._log = MetricsLog(metrics_path)
        optimizer, batches, log, done = self._optimizer, self._batches, self._log, self.steps_done
        schedule = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, steps)
        bar, started = progress_bar(steps, "SFT", cfg.progress), time.time()
        model.train()
        loss_value = math.nan
        device_type = next(model.parameters()).device.type
        bf16 = resolve_mixed_precision(cfg.mixed_precision, device_type) == "bf16"
        for step in range(steps):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = sft_loss(model, batches.next(), cfg.share_prefix)
            loss.backward()
            if cfg.max_grad_norm:  # None or 0: no clipping
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()
            self.steps_done = done + step + 1
            if (step + 1) % cfg.logging_steps == 0 or step + 1 == steps:
                row = {"step": self.steps_done, "loss": loss_value, "learning_rate": schedule.get_last_lr()[0],
                       "epoch": self.steps_done * cfg.batch_size / len(self.examples),
                       "time": round(time.time() - started, 1)}
                self.history.append(row)
                log.write(row)
            if bar is not None:
                bar.update(1)
                if step % 20 == 0:
                    bar.set_postfix(loss=f"{loss_value:.3f}")
        if bar is not None:
            bar.close()
        model.eval()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"SFT diverged (loss {loss_value}); lower sft.learning_rate")
        return self.history

    def save_model(self, output_dir: str) -> None:
        """A plain model directory (LoRA merged into the weights) with the tokenizer, written atomically."""
        from agentrl.checkpoint import save_atomically

        model = self.model
        if hasattr(model, "merge_and_unload"):  # a PEFT model: RL and evaluation load the merged weights
            model = self.model = model.merge_and_unload()
        finite_or_raise(model)
        save_atomically(output_dir, lambda d: (model.save_pretrained(d), self.tokenizer.save_pretrained(d)))


def demonstrations_from_function(spec: str, tasks: list[dict], n: int, seed: int) -> list:
    """`n` rows from calls of the `module:function(task, rng)` at `spec`, cycling over `tasks` in order, with
    one `random.Random(seed)` shared by the calls (so the set is reproducible)."""
    from agentrl.envs.base import load_object

    if not tasks:
        raise UserError("env.demonstrations: no training tasks to demonstrate")
    try:
        demonstrate = load_object(spec)
    except ValueError as e:
        raise UserError(f"env.demonstrations: {e}") from None
    rng = random.Random(seed)
    return [demonstrate(tasks[i % len(tasks)], rng) for i in range(n)]


def demonstration_texts(rows: list) -> list[str]:
    """The plain text of each row, for training a tokenizer on the demonstrations (roles included in chats)."""
    texts = []
    for row in rows:
        if isinstance(row, (list, tuple)):
            row = {"segments": row}
        if isinstance(row, dict) and isinstance(row.get("segments"), (list, tuple)):
            texts.append("".join(str(s.get("text", "") if isinstance(s, dict) else s[0]) for s in row["segments"]
                                 if isinstance(s, (dict, list, tuple)) and s))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            texts.append("\n".join(f"{m.get('role', '')}\n{m.get('content') or ''}"
                                   + "".join(json.dumps(c) for c in m.get("tool_calls") or [])
                                   for m in row["messages"] if isinstance(m, dict)))
    return texts
