"""The embedded base model, built by plain SFT (trainers/sft.py) of a fresh tiny Llama on demonstrations:
a built-in corpus (`agentrl base-model`; each corpus lives beside its environment in agentrl/envs), or an
environment's own demonstrations (`model.base: embedded` with `env.demonstrations`, or `agentrl sft`).

A byte-level BPE tokenizer is trained on the demonstrations themselves, then the model learns them; both are
saved atomically with `save_pretrained`. A directory is a cache keyed on what its model was built from (the
builder config, plus a hash of the demonstrations and the SFT config), so it is never reused for another
corpus or another environment's demonstrations.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from agentrl.checkpoint import check_replaceable, save_atomically
from agentrl.envs.base import Corpus, Segments
from agentrl.models.tiny import BaseModelConfig, build_tokenizer, tiny_llama
from agentrl.trainers.sft import (Example, SFTConfig, SFTTrainer, collate, demonstration_texts, encode_demonstrations,
                                  read_demonstrations)

META_FILE = "agentrl_base.json"
CORPUS = "corpus"  # the source of a model built from BaseModelConfig.corpus


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
def demonstration_accuracy(model, examples: list[Example], pad_id: int) -> float:
    """Fraction of demonstrations whose every trainable token is the model's argmax given the true prefix.

    That is exactly "greedy decoding reproduces the demonstration turn by turn", in one forward pass.
    """
    batch = collate(examples, pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predicted, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    wrong = ((predicted != labels) & (labels != -100)).any(-1)
    return float(1.0 - wrong.float().mean())


def is_built(out_dir: str | Path, config: BaseModelConfig, source: str = CORPUS) -> bool:
    meta = Path(out_dir) / META_FILE
    if not meta.exists():
        return False
    try:
        meta = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("config") == asdict(config) and meta.get("source", CORPUS) == source


def _save(out_dir: Path, model, tokenizer, meta: dict) -> None:
    save_atomically(out_dir, lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d),
                                        (Path(d) / META_FILE).write_text(json.dumps(meta, indent=2))))


def build_base_model(out_dir: str | Path, config: BaseModelConfig | None = None, progress: bool = True) -> Path:
    """Train the tokenizer and the tiny Llama on the built-in corpus `config.corpus`, save both to `out_dir`
    (atomically), and return it. Reuses `out_dir` when it holds a model of the same config. Deterministic."""
    from agentrl.envs import CORPORA

    config = config or BaseModelConfig()
    out_dir = Path(out_dir)
    if is_built(out_dir, config):
        return out_dir
    check_replaceable(out_dir, "model.base_dir")  # before minutes of training
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
    model = tiny_llama(config, tokenizer)
    # One pass over the demonstrations in order: exactly `steps` batches.
    sft = SFTConfig(steps=config.steps, batch_size=config.batch_size, learning_rate=config.learning_rate,
                    warmup_steps=config.warmup_steps, shuffle=False, seed=config.seed, progress=progress)
    trainer = SFTTrainer(model, sft, demos, tokenizer, dataset_name=f"corpus {config.corpus}")
    history = trainer.train()
    probe_tasks = make_tasks(200, seed=config.seed, split="eval")
    probe, _, _ = encode_demonstrations(read_demonstrations(
        [_skip_decision(demonstrate(t, True, rng), corpus.decision) for t in probe_tasks]), tokenizer)
    meta = {"config": asdict(config), "source": CORPUS, "final_loss": history[-1]["loss"],
            "tool_demo_exact_match": demonstration_accuracy(model, probe, tokenizer.pad_token_id),
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.time() - started, 1)}
    _save(out_dir, model, tokenizer, meta)
    return out_dir


def reproducible_fraction(examples: list[Example], probe: list[Example]) -> float:
    """The share of `probe`'s rows that the demonstrations always write the same way: every trained token is the
    one all `examples` with the same ids before it have next. Deterministic demonstrations give 1; those random by
    design (a coin flip for calling the tool, a guessed number) much less, since no model reproduces a coin flip.
    Unanimity, not a majority: with ~10 rows a task, a majority of coin flips is noise (0.35 for
    examples/units_env.py's 40/60 calls, where the models reproduce ~0)."""
    from collections import defaultdict

    def prompt(example: Example) -> tuple[int, ...]:  # the ids before the first trained token
        ids, labels = example
        return tuple(ids[:next((i for i, label in enumerate(labels) if label != -100), len(ids))])

    wanted = {prompt(example) for example in probe}
    same_prompt = defaultdict(list)
    for example in examples:
        if (key := prompt(example)) in wanted:
            same_prompt[key].append(example[0])
    reproducible = 0
    for example in probe:
        ids, labels = example
        rows = same_prompt[prompt(example)]
        for j in (j for j, label in enumerate(labels) if label != -100 and j > 0):  # token j, predicted from ids[:j]
            if {r[j] for r in rows if len(r) > j and r[:j] == ids[:j]} != {ids[j]}:
                break
        else:
            reproducible += 1
    return reproducible / max(len(probe), 1)


# A round of training past sft.steps that raises demo_exact_match by less than this: the demonstrations are as
# reproduced as they will be (random by design: a scripted player's coin flips), so the builder stops there.
MIN_ROUND_GAIN = 0.02


def train_until_reproduced(trainer: SFTTrainer, sft: SFTConfig, name: str | None = None) -> dict[int, float]:
    """After `sft.steps`, more rounds of `sft.steps` (warm restarts) while the model reproduces fewer than
    sft.min_demo_exact_match of the demonstrations (the first 200) that can be reproduced (reproducible_fraction:
    random choices in them cannot), up to sft.max_steps (None: 4 x steps) or a round that gains less than
    MIN_ROUND_GAIN; returns demo_exact_match after each round ({steps trained: match},
    the last the model's) and warns when it stays short. A model
    that reaches it in `sft.steps` trains exactly as before: a new environment gets a base model as good as the
    shipped ones, which do."""
    import warnings

    def exact_match() -> float:
        return demonstration_accuracy(trainer.model, trainer.examples[:200], trainer.tokenizer.pad_token_id)

    exact, bound, target = exact_match(), sft.max_steps or 4 * sft.steps, sft.min_demo_exact_match
    rounds = {trainer.steps_done: exact}
    if exact < target:  # only then is the ceiling worth computing
        target *= reproducible_fraction(trainer.examples, trainer.examples[:200])
    while exact < target and trainer.steps_done < bound:
        before = exact
        trainer.train(steps=min(sft.steps, bound - trainer.steps_done))
        exact = rounds[trainer.steps_done] = exact_match()
        if exact - before < MIN_ROUND_GAIN:
            break
    if exact < target:
        why = ("at sft.max_steps" if trainer.steps_done >= bound else
               f"where a round of {sft.steps} steps gained less than {MIN_ROUND_GAIN}")
        warnings.warn(f"{name or 'SFT'}: the base model reproduces {exact:.2f} of its demonstrations "
                      f"(demo_exact_match < {target:.2f}: sft.min_demo_exact_match={sft.min_demo_exact_match:g} of "
                      f"the {target / sft.min_demo_exact_match:.2f} a model can reproduce) after "
                      f"{trainer.steps_done} steps, stopped {why}; RL will start from a weak policy. Raise "
                      f"sft.max_steps (now {bound}) or sft.steps, or set sft.min_demo_exact_match lower (0: off) if the "
                      f"demonstrations are random by design", stacklevel=3)
    return rounds


def demonstrations_key(rows: list, sft: SFTConfig, chat: bool) -> str:
    """What a model of demonstrations is built from, as a hash: the rows, the SFT settings, the template."""
    training = {k: v for k, v in asdict(sft).items() if k not in ("data", "progress", "logging_steps")}
    blob = json.dumps({"rows": rows, "sft": training, "chat": chat}, sort_keys=True, default=str)
    return "demonstrations:" + hashlib.sha256(blob.encode()).hexdigest()


def build_from_demonstrations(out_dir: str | Path, demonstrations, config: BaseModelConfig, sft: SFTConfig,
                              chat: bool = False, name: str | None = None, progress: bool = True,
                              metrics_path: str | None = None) -> Path:
    """A fresh tiny model (architecture and vocabulary size from `config`) whose tokenizer is trained on the
    demonstrations (a JSONL path or a list of rows) and which then learns them by SFT with `sft`; cached in
    `out_dir` under their hash. `chat`: the tokenizer gets the ChatML tool template (chat environments)."""
    from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE

    rows = [row for _, row in read_demonstrations(demonstrations, name)]
    out_dir, source = Path(out_dir), demonstrations_key(rows, sft, chat)
    if is_built(out_dir, config, source):
        return out_dir
    check_replaceable(out_dir)
    started = time.time()
    torch.manual_seed(sft.seed)
    markers = ("<|im_start|>", "<|im_end|>") if chat else ()
    texts = demonstration_texts(rows[:5000])  # plenty for BPE, as for the corpora
    tokenizer = build_tokenizer(texts, config.vocab_size, markers, CHATML_TOOLS_TEMPLATE if chat else None)
    model = tiny_llama(config, tokenizer)
    trainer = SFTTrainer(model, replace(sft, progress=progress), demonstrations, tokenizer, dataset_name=name)
    history = trainer.train(metrics_path)
    rounds = train_until_reproduced(trainer, sft, name)
    meta = {"config": asdict(config), "source": source, "sft": asdict(sft), "final_loss": history[-1]["loss"],
            "demonstrations": len(trainer.examples), "skipped_rows": trainer.skipped_rows, "truncated_rows": trainer.truncated_rows,
            "demo_exact_match": rounds[trainer.steps_done], "trained_steps": trainer.steps_done,
            "demo_exact_match_rounds": {str(k): v for k, v in rounds.items()},
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.time() - started, 1)}
    _save(out_dir, model, tokenizer, meta)
    return out_dir
