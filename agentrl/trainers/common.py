"""Pieces every trainer shares: logprob computation, batching of episodes, metrics logging."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrl.algos.losses import entropy_from_logits
from agentrl.rollout.engine import Episode
from agentrl.rollout.sampling import position_ids  # noqa: F401  (re-exported for trainers)


@dataclass
class TokenBatch:
    """Right-padded sequences with per-position training targets.

    input_ids, attention_mask: (B, T). Everything else is (B, T-1), indexed by the position that
    *predicts* token t+1:  loss_mask 1 where token t+1 was sampled by the policy, 0 on prompt,
    observation and padding;  scores hold each turn's reward at the index predicting that turn's last token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    scores: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "TokenBatch":
        """Rows `idx`, trimmed to their longest sequence."""
        width = int(self.attention_mask[idx].sum(-1).max())
        return TokenBatch(self.input_ids[idx, :width], self.attention_mask[idx, :width],
                          self.loss_mask[idx, : width - 1], self.scores[idx, : width - 1])


def build_batch(rows: list[tuple[list[int], list[int], list[tuple[int, float]]]], pad_id: int) -> TokenBatch:
    """rows: (token ids, per-token sampled flag, [(token index, reward)]) -> TokenBatch."""
    width = max(len(ids) for ids, _, _ in rows)
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width - 1))
    scores = torch.zeros((B, width - 1))
    for i, (ids, sampled, rewards) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # Token j is predicted at position j - 1; the first token (BOS / prompt start) is never a target.
        loss_mask[i, : len(ids) - 1] = torch.tensor(sampled[1:], dtype=torch.float)
        for j, r in rewards:
            scores[i, j - 1] += r
    return TokenBatch(input_ids, attention, loss_mask, scores)


def episodes_to_batch(episodes: list[Episode], pad_id: int, missing_eos_penalty: float | None = None) -> TokenBatch:
    """Episodes -> TokenBatch. Each turn's reward sits on that turn's last sampled token."""
    rows = []
    for ep in episodes:
        n = len(ep.prompt_ids)
        rewards = [(n + end, r) for end, r in zip(ep.turn_ends, ep.turn_rewards)]
        if missing_eos_penalty is not None and ep.truncated and rewards:
            rewards[-1] = (rewards[-1][0], rewards[-1][1] - missing_eos_penalty)
        rows.append((ep.prompt_ids + ep.token_ids, [0] * n + ep.loss_mask, rewards))
    return build_batch(rows, pad_id)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (B, T, V), input_ids (B, T) -> logprobs (B, T-1) of tokens 1..T-1 under logits / temperature.

    Dividing by the sampling temperature here, for old, new and reference logprobs alike, keeps the
    ratio and the KL about the distribution that was actually sampled (Huang et al. 2024).
    """
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def policy_forward(model, batch: TokenBatch, temperature: float, with_entropy: bool = False):
    """Value-head model forward -> (logprobs (B, T-1), values (B, T-1), entropy (B, T-1) or None, logits)."""
    logits, _, values = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=position_ids(batch.attention_mask))
    entropy = entropy_from_logits(logits[:, :-1].float() / temperature) if with_entropy else None
    return token_logprobs(logits, batch.input_ids, temperature), values[:, :-1].float(), entropy, logits


def lm_logprobs(lm, batch: TokenBatch, temperature: float, return_logits: bool = False):
    """Plain causal-LM forward -> logprobs (B, T-1) (and the logits (B, T, V) when asked)."""
    from agentrl.models.value_head import accepts_position_ids

    # BLOOM's forward takes no position_ids (ALiBi reads the attention mask).
    positions = {"position_ids": position_ids(batch.attention_mask)} if accepts_position_ids(lm) else {}
    logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **positions).logits
    logprobs = token_logprobs(logits, batch.input_ids, temperature)
    return (logprobs, logits) if return_logits else logprobs


def norm_gain_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Trainable gains of normalisation layers (under LoRA: the `modules_to_save` copies add_lora makes)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n and "v_head" not in n]


def optimizer_groups(params: list, lr: float, own_rates: list[tuple[list, float | None]]) -> list[dict]:
    """Adam parameter groups: `params` at `lr`, except each (subset, rate) of `own_rates` at its own rate.

    Why the norm gains get their own rate: Adam moves every weight by about lr a step, so at a LoRA rate
    (5e-4) a gain of ~1.3 changes by ~10% in a whole demo; the temperature-1 policy is sharpened by
    exactly that scale (docs/sampled-accuracy.md). Per-group rates for parameters of different roles are
    what LoRA+ (Hayou et al. 2024, arXiv:2402.12354) does for LoRA's A and B.
    """
    special = [(subset, rate) for subset, rate in own_rates if subset and rate is not None]
    taken = {id(p) for subset, _ in special for p in subset}
    groups = [{"params": [p for p in params if id(p) not in taken]}]
    groups += [{"params": subset, "lr": rate} for subset, rate in special]
    return groups


class MetricsLog:
    """One row per step: appended to a `.jsonl` file (flushed each row, so a crash loses nothing) and, where
    the accelerator has trackers (TensorBoard, W&B, ...), its numbers sent to them."""

    def __init__(self, path: str | Path | None, accelerator=None):
        self.path = Path(path) if path else None
        self.accelerator = accelerator
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, row: dict, step: int | None = None) -> None:
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        if self.path:
            clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
            with self.path.open("a") as f:
                f.write(json.dumps(clean if step is None else {"step": step, **clean}) + "\n")


class TaskCycler:
    """Draws tasks in shuffled passes over the task list, deterministically for a seed."""

    def __init__(self, tasks: list[dict], seed: int):
        if not tasks:
            raise ValueError("training needs at least one task")
        self.tasks, self.order = tasks, []
        self.rng = random.Random(seed)

    def draw(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.tasks)))
                self.rng.shuffle(self.order)
            out.append(self.tasks[self.order.pop()])
        return out


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar (step, ETA) or None."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def finite_or_raise(model: torch.nn.Module) -> None:
    """Refuse to checkpoint a model with NaN/inf in its trainable weights."""
    bad = [n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"refusing to save: non-finite values in {bad[:3]}")
