"""The job behind `agentrl base-model`: the embedded default model, built from a corpus of synthetic
demonstrations (the built-in environments' corpora live beside them in agentrl/envs).

A byte-level BPE tokenizer is trained on the demonstrations, then a tiny Llama learns them, and both are
saved atomically with `save_pretrained`. The result is cached: the same config reuses the directory.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

from agentrl.checkpoint import save_atomically
from agentrl.envs.base import Corpus, Segments
from agentrl.models.tiny import BaseModelConfig, build_tokenizer, tiny_llama_config

META_FILE = "agentrl_base.json"


def _encode(tokenizer, segments: Segments, eos_id: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one demonstration, tokenized segment by segment as the rollout engine does."""
    return _encode_many(tokenizer, [segments], eos_id)[0]


def _encode_many(tokenizer, demos: list[Segments], eos_id: int) -> list[tuple[list[int], list[int]]]:
    """Many demonstrations at once: one batched tokenizer call over all segments (fast, in Rust)."""
    texts = [text for demo in demos for text, _ in demo]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for demo in demos:
        ids, labels = list(bos), [-100] * len(bos)  # the prompt starts with BOS, as tokenizer(prompt) gives
        for _text, trainable in demo:
            piece = next(pieces)
            ids += piece
            labels += piece if trainable else [-100] * len(piece)
        out.append((ids + [eos_id], labels + [eos_id]))
    return out


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):  # right padding for training
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def _skip_decision(segments: Segments, decision: str = Corpus.decision) -> Segments:
    """Mark where the model's first turn decides (a ReAct Thought line, the first token of a chat turn) as not
    scored, so the probe measures the skills RL relies on (copying the call, reading the observation), not
    the choice."""
    k = next(i for i, (_, trainable) in enumerate(segments) if trainable)
    match = re.match(decision, segments[k][0])
    cut = match.end() if match else 0
    head, rest = segments[k][0][:cut], segments[k][0][cut:]
    return segments[:k] + [(head, False), (rest, True)] + segments[k + 1:]


@torch.no_grad()
def demonstration_accuracy(model, examples: list[tuple[list[int], list[int]]], pad_id: int) -> float:
    """Fraction of demonstrations whose every trainable token is the model's argmax given the true prefix.

    That is exactly "greedy decoding reproduces the demonstration turn by turn", in one forward pass.
    """
    batch = _batch(examples, pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predicted, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    wrong = ((predicted != labels) & (labels != -100)).any(-1)
    return float(1.0 - wrong.float().mean())


def is_built(out_dir: str | Path, config: BaseModelConfig) -> bool:
    meta = Path(out_dir) / META_FILE
    if not meta.exists():
        return False
    try:
        return json.loads(meta.read_text()).get("config") == asdict(config)
    except json.JSONDecodeError:
        return False


def build_base_model(out_dir: str | Path, config: BaseModelConfig | None = None, progress: bool = True) -> Path:
    """Train the tokenizer and the tiny Llama, save both to `out_dir` (atomically), and return it.

    Reuses `out_dir` when it already holds a model built from the same config. Deterministic for a seed.
    """
    config = config or BaseModelConfig()
    out_dir = Path(out_dir)
    if is_built(out_dir, config):
        return out_dir
    from agentrl.envs import CORPORA

    if config.corpus not in CORPORA:
        raise ValueError(f"unknown corpus {config.corpus!r}; choose one of {sorted(CORPORA)}")
    started = time.time()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    corpus = CORPORA[config.corpus]
    make_tasks, demonstrate = corpus.tasks, corpus.demonstrate
    n_examples = config.steps * config.batch_size
    tasks = make_tasks(n_examples, seed=config.seed, split="train", unique=False)
    demos = [demonstrate(t, rng.random() < config.tool_fraction, rng) for t in tasks]

    # The first four segments of 5,000 demonstrations are plenty for BPE (and keep the built models as measured).
    tokenizer = build_tokenizer(["".join(text for text, _ in d[:4]) for d in demos[:5000]], config.vocab_size,
                                corpus.special_tokens, corpus.chat_template)
    encoded = _encode_many(tokenizer, demos, tokenizer.eos_token_id)
    model = LlamaForCausalLM(tiny_llama_config(config, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.steps)
    model.train()
    iterator = range(config.steps)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="base model (SFT)", dynamic_ncols=True)
    loss_value = math.nan
    for step in iterator:
        batch = _batch(encoded[step * config.batch_size:(step + 1) * config.batch_size], tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if progress and step % 20 == 0:
            iterator.set_postfix(loss=f"{loss_value:.3f}")
    if not math.isfinite(loss_value):
        raise RuntimeError(f"base-model training diverged (loss {loss_value}); nothing was saved")
    model.eval()
    probe_tasks = make_tasks(200, seed=config.seed, split="eval")
    probe = _encode_many(tokenizer, [_skip_decision(demonstrate(t, True, rng), corpus.decision) for t in probe_tasks],
                         tokenizer.eos_token_id)
    meta = {"config": asdict(config), "final_loss": loss_value,
            "tool_demo_exact_match": demonstration_accuracy(model, probe, tokenizer.pad_token_id), "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.time() - started, 1)}
    save_atomically(out_dir, lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d),
                                         (Path(d) / META_FILE).write_text(json.dumps(meta, indent=2))))
    return out_dir
