"""The embedded default model: a tokenizer and a tiny Llama trained here, on synthetic tool-use traces.

Nothing can be downloaded at run time, so agentrl builds its own base model in about a minute on a
laptop CPU. It is saved with `save_pretrained`, so every other part of agentrl loads it exactly as it
would load a real checkpoint (`AutoModelForCausalLM.from_pretrained(dir)`).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, get_cosine_schedule_with_warmup

Segments = list[tuple[str, bool]]  # (text, trainable) pieces of one demonstration
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
META_FILE = "agentrl_base.json"


@dataclass
class BaseModelConfig:
    """How the embedded base model is built. The defaults are the smallest that learned reliably here."""

    corpus: str = "calculator"  # which synthetic demonstrations to learn (see CORPORA)
    tool_fraction: float = 0.4  # share of demonstrations that do the job right (call the tool / every call)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    steps: int = 600
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    vocab_size: int = 512  # an upper bound: BPE on these traces stops near 315 tokens
    seed: int = 0


@dataclass
class Corpus:
    """Synthetic demonstrations to learn: tasks(n, seed, split, unique), demonstrate(task, right, rng)."""

    tasks: Callable
    demonstrate: Callable
    special_tokens: tuple[str, ...] = ()  # extra special tokens (chat markers)
    chat_template: str | None = None  # saved with the tokenizer
    decision: str = r"[^\n]*\n"  # regex: where a turn decides to call or not (not scored by the probe)


def _calculator_corpus() -> Corpus:
    from agentrl.envs.calculator import calculator_demonstration, calculator_tasks

    return Corpus(calculator_tasks, calculator_demonstration)


def _multistep_corpus() -> Corpus:
    from agentrl.envs.calculator import multistep_demonstration, multistep_tasks

    return Corpus(multistep_tasks, multistep_demonstration)


def _chat_corpus() -> Corpus:
    from agentrl.envs.calculator import calculator_tasks, chat_calculator_demonstration
    from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE

    return Corpus(calculator_tasks, chat_calculator_demonstration, ("<|im_start|>", "<|im_end|>"),
                  CHATML_TOOLS_TEMPLATE, decision="<")  # the "<" of <tool_call>: its own token


def _search_corpus() -> Corpus:
    from agentrl.envs.search import search_demonstration, search_practice_tasks

    return Corpus(search_practice_tasks, search_demonstration)


CORPORA: dict[str, Callable[[], Corpus]] = {"calculator": _calculator_corpus, "multistep": _multistep_corpus,
                                            "chat": _chat_corpus, "search": _search_corpus}


def build_tokenizer(texts: list[str], vocab_size: int, extra_special: tuple[str, ...] = (),
                    chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE with every digit its own token (so numbers copy digit by digit), BOS/EOS/PAD distinct."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        clean_up_tokenization_spaces=False, additional_special_tokens=list(extra_special) or None,
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


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
    if config.corpus not in CORPORA:
        raise ValueError(f"unknown corpus {config.corpus!r}; choose one of {sorted(CORPORA)}")
    started = time.time()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    corpus = CORPORA[config.corpus]()
    make_tasks, demonstrate = corpus.tasks, corpus.demonstrate
    n_examples = config.steps * config.batch_size
    tasks = make_tasks(n_examples, seed=config.seed, split="train", unique=False)
    demos = [demonstrate(t, rng.random() < config.tool_fraction, rng) for t in tasks]

    # The first four segments of 5,000 demonstrations are plenty for BPE (and keep the built models as measured).
    tokenizer = build_tokenizer(["".join(text for text, _ in d[:4]) for d in demos[:5000]], config.vocab_size,
                                corpus.special_tokens, corpus.chat_template)
    encoded = _encode_many(tokenizer, demos, tokenizer.eos_token_id)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attention_dropout=0.0,
    )
    model = LlamaForCausalLM(model_config)
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


def save_atomically(out_dir: str | Path, write: Callable[[str], object]) -> None:
    """Write into a temporary sibling directory, then swap it into place, so a crash never leaves half a model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(str(tmp))
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
