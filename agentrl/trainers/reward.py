"""Bradley-Terry reward models from preference pairs (RLHF's step 2), usable as PPO's score.

A reward model is a causal-LM backbone (LoRA or full) with a scalar head on the hidden state of the last
token, or any `AutoModelForSequenceClassification` with one label. Trained with -logsigmoid(s_c - s_r).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from agentrl.algos.dpo import bradley_terry_loss
from agentrl.checkpoint import check_replaceable, save_atomically
from agentrl.errors import UserError
from agentrl.preferences import PreferenceExample, load_preferences
from agentrl.trainers.common import MetricsLog, build_batch, finite_or_raise, position_ids, progress_bar

HEAD_FILE = "reward_head.safetensors"
META_FILE = "agentrl_reward_model.json"


class RewardModel(nn.Module):
    """backbone + Linear(hidden, 1) on the last real token; head init std 1/sqrt(d+1) (Huang et al. 2024).

    With `sequence_classification`, the backbone is an `AutoModelForSequenceClassification` (num_labels=1)
    whose own score head is used and the extra head stays unused.
    """

    def __init__(self, backbone: nn.Module, sequence_classification: bool = False):
        super().__init__()
        self.backbone, self.sequence_classification = backbone, sequence_classification
        hidden = backbone.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        if sequence_classification:
            self.head.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) right-padded -> scores (B,)."""
        if self.sequence_classification:
            return self.backbone(input_ids=input_ids, attention_mask=attention_mask).logits.float().squeeze(-1)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids(attention_mask), output_hidden_states=True)
        last = attention_mask.sum(-1) - 1
        hidden = out.hidden_states[-1][torch.arange(len(last)), last]
        return self.head(hidden.float()).squeeze(-1)

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]], pad_id: int, batch_size: int = 64) -> list[float]:
        """Scores of whole token sequences (prompt + trajectory)."""
        self.eval()
        device = self.head.weight.device
        out = []
        for start in range(0, len(sequences), batch_size):
            rows = [(s, [0] * len(s), []) for s in sequences[start:start + batch_size]]
            b = build_batch(rows, pad_id)
            out += self(b.input_ids.to(device), b.attention_mask.to(device)).tolist()
        return out

    def save_pretrained(self, directory: str) -> None:
        from safetensors.torch import save_file

        self.backbone.save_pretrained(directory)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                  str(Path(directory) / HEAD_FILE))


def _auto_class(sequence_classification: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM


def load_reward_model(path: str) -> tuple[RewardModel, object]:
    """(reward model, tokenizer) from a directory written by `agentrl reward-model`."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise UserError(f"{path}: not a reward model directory (no {META_FILE})")
    meta = json.loads(meta_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    seq_cls = meta.get("kind") == "sequence-classification"
    auto = _auto_class(seq_cls)
    kwargs = {"num_labels": 1, "pad_token_id": tokenizer.pad_token_id} if seq_cls else {}
    if meta["lora"]:
        from peft import PeftModel

        backbone = PeftModel.from_pretrained(auto.from_pretrained(meta["base"], **kwargs), path)
    else:
        backbone = auto.from_pretrained(path, **kwargs)
    model = RewardModel(backbone, seq_cls)
    model.head.load_state_dict(load_file(str(path / HEAD_FILE)))
    return model.eval(), tokenizer


@dataclass
class RewardModelConfig:
    data: str = "runs/dpo/pairs-round0.jsonl"  # preference pairs (JSONL, datasets dir or name)
    base: str = "runs/base-model"  # backbone model directory
    kind: Literal["value-head", "sequence-classification"] = "value-head"  # scalar head on a causal LM, or
    # AutoModelForSequenceClassification(num_labels=1)
    out_dir: str = "runs/reward-model"  # where the reward model is saved
    lora: bool = True  # LoRA on the backbone (head always trained); False: full fine-tuning
    lora_r: int = 16  # LoRA rank
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    learning_rate: float = 1e-3  # AdamW learning rate
    batch_size: int = 16  # pairs per step
    epochs: int = 3  # passes over the training pairs
    eval_fraction: float = 0.2  # held-out share of the pairs for pairwise accuracy
    max_length: int = 256  # prompt + completion tokens
    max_prompt_length: int = 128  # longer prompts are a data error
    seed: int = 0  # random seed
    progress: bool = True  # progress bar


def _pair_sequences(examples: list[PreferenceExample]) -> tuple[list[list[int]], list[list[int]]]:
    return ([e.prompt_ids + e.chosen_ids for e in examples], [e.prompt_ids + e.rejected_ids for e in examples])


def pairwise_accuracy(model: RewardModel, examples: list[PreferenceExample], pad_id: int) -> float:
    chosen, rejected = _pair_sequences(examples)
    c, r = model.score_ids(chosen, pad_id), model.score_ids(rejected, pad_id)
    return sum(a > b for a, b in zip(c, r)) / max(len(examples), 1)


def train_reward_model(config: RewardModelConfig) -> dict:
    """Train on (1 - eval_fraction) of the pairs, report pairwise accuracy on the rest, save atomically."""
    from transformers import AutoTokenizer

    check_replaceable(config.out_dir, "out_dir")  # before the training, not at the save
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.base)
    examples, skipped = load_preferences(config.data, tokenizer, config.max_length, config.max_prompt_length)
    rng = random.Random(config.seed)
    rng.shuffle(examples)
    n_eval = max(1, int(len(examples) * config.eval_fraction)) if len(examples) > 1 else 0
    held_out, train = examples[:n_eval], examples[n_eval:]
    seq_cls = config.kind == "sequence-classification"
    kwargs = {"num_labels": 1, "pad_token_id": tokenizer.pad_token_id} if seq_cls else {}
    backbone = _auto_class(seq_cls).from_pretrained(config.base, **kwargs)
    if config.lora:
        from peft import LoraConfig, get_peft_model

        # the classification head ("score") must train too
        backbone = get_peft_model(backbone, LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r,
                                                       target_modules=list(config.target_modules),
                                                       modules_to_save=["score"] if seq_cls else None))
    model = RewardModel(backbone, seq_cls).eval()  # eval: dropout off
    pad = tokenizer.pad_token_id
    before = pairwise_accuracy(model, held_out, pad) if held_out else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    steps = config.epochs * max(1, (len(train) + config.batch_size - 1) // config.batch_size)
    bar, started, log = progress_bar(steps, "reward model", config.progress), time.time(), []
    metrics = MetricsLog(Path(config.out_dir).with_name(Path(config.out_dir).name + "-metrics.jsonl"))
    for epoch in range(config.epochs):
        rng.shuffle(train)
        for start in range(0, len(train), config.batch_size):
            chunk = train[start:start + config.batch_size]
            chosen, rejected = _pair_sequences(chunk)
            b = build_batch([(s, [0] * len(s), []) for s in chosen + rejected], pad)
            scores = model(b.input_ids, b.attention_mask)
            loss = bradley_terry_loss(scores[: len(chunk)], scores[len(chunk):]).mean()
            optimizer.zero_grad(set_to_none=True)
            if torch.isfinite(loss):
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            row = {"epoch": epoch, "loss": loss.item(),
                   "accuracy": (scores[: len(chunk)] > scores[len(chunk):]).float().mean().item()}
            log.append(row)
            metrics.write(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.3f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    after = pairwise_accuracy(model, held_out, pad) if held_out else None
    finite_or_raise(model)
    meta = {"base": str(config.base), "lora": config.lora, "kind": config.kind, "train_pairs": len(train), "eval_pairs": len(held_out),
            "skipped_rows": skipped, "eval_accuracy_before": before, "eval_accuracy": after,
            "train_seconds": round(time.time() - started, 1)}
    save_atomically(config.out_dir, lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d),
                                                (Path(d) / META_FILE).write_text(json.dumps(meta, indent=2))))
    return meta


class RewardModelScorer:
    """Adds reward-model scores to episodes: score = env_weight * env score + weight * combine(RM scores).

    Several reward models are combined by their mean or their min (a guard against one model being hacked).
    The final turn's reward carries the reward-model part, so PPO puts it on the last token.
    """

    def __init__(self, paths: list[str], policy_tokenizer, weight: float = 1.0, env_weight: float = 1.0,
                 combine: str = "mean"):
        if combine not in ("mean", "min"):
            raise ValueError(f"reward.combine must be 'mean' or 'min', got {combine!r}")
        self.models = [load_reward_model(p) for p in paths]
        self.policy_tokenizer, self.weight, self.env_weight, self.combine = policy_tokenizer, weight, env_weight, combine

    def _sequences(self, episodes, tokenizer) -> list[list[int]]:
        if tokenizer.get_vocab() == self.policy_tokenizer.get_vocab():
            return [ep.prompt_ids + ep.token_ids for ep in episodes]  # same vocabulary: the exact ids
        texts = [self.policy_tokenizer.decode(ep.prompt_ids + ep.token_ids, skip_special_tokens=True) for ep in episodes]
        return tokenizer(texts)["input_ids"]

    def __call__(self, episodes) -> None:
        per_model = [model.score_ids(self._sequences(episodes, tok), tok.pad_token_id) for model, tok in self.models]
        for i, ep in enumerate(episodes):
            values = [scores[i] for scores in per_model]
            rm = min(values) if self.combine == "min" else sum(values) / len(values)
            ep.turn_rewards = [self.env_weight * r for r in ep.turn_rewards]
            ep.turn_rewards[-1] += self.weight * rm
            ep.info = {**ep.info, "reward_model_score": rm}
