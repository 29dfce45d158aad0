"""Pieces every trainer shares: logprob computation, batching of episodes, metrics logging."""

from __future__ import annotations

import inspect
import random
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from agentrl.algos.losses import entropy_from_logits
from agentrl.checkpoint import strict_json
from agentrl.distributed import (all_finite, gathered_for_generation, global_logprob_mismatch,  # noqa: F401
                                 global_masked_moments, global_token_scale, make_accelerator, mean_over_processes,
                                 sum_over_processes)
from agentrl.rollout.engine import Episode
from agentrl.rollout.sampling import index_logits_to_keep, position_ids  # noqa: F401  (position_ids: re-exported)


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
    logprobs: torch.Tensor | None = None  # (B, T-1) the sampler's logprobs on sampled tokens (rollouts only)
    values: torch.Tensor | None = None  # (B, T-1) the sampler's values on sampled tokens (PPO rollouts, if read)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "TokenBatch":
        """Rows `idx`, trimmed to their longest sequence."""
        width = int(self.attention_mask[idx].sum(-1).max())
        return TokenBatch(self.input_ids[idx, :width], self.attention_mask[idx, :width],
                          self.loss_mask[idx, : width - 1], self.scores[idx, : width - 1],
                          *(None if x is None else x[idx, : width - 1] for x in (self.logprobs, self.values)))

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(None if x is None else x.to(device) for x in (
            self.input_ids, self.attention_mask, self.loss_mask, self.scores, self.logprobs, self.values)))


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
    batch = build_batch(rows, pad_id)
    batch.logprobs = torch.zeros_like(batch.loss_mask)
    with_values = bool(episodes) and all(ep.values is not None for ep in episodes)
    batch.values = torch.zeros_like(batch.loss_mask) if with_values else None
    for i, ep in enumerate(episodes):  # token n + k of the sequence is predicted at position n + k - 1
        n = len(ep.prompt_ids)
        batch.logprobs[i, n - 1: n - 1 + len(ep.logprobs)] = torch.tensor(ep.logprobs, dtype=torch.float)
        if with_values:
            batch.values[i, n - 1: n - 1 + len(ep.values)] = torch.tensor(ep.values, dtype=torch.float)
    return batch


def check_batch(episodes: list[Episode], batch: TokenBatch) -> None:
    """Fail loudly unless, episode by episode, the ids trained are the ids the rollout produced and the
    loss mask is 1 on exactly the tokens the policy sampled (each turn's last token among them)."""
    ids, mask = batch.input_ids.tolist(), batch.loss_mask.tolist()
    for i, ep in enumerate(episodes):
        n, m = len(ep.prompt_ids), len(ep.token_ids)
        if not len(ep.loss_mask) == m == len(ep.logprobs):
            raise RuntimeError(f"episode {i}: {m} token ids but {len(ep.loss_mask)} loss_mask and "
                               f"{len(ep.logprobs)} logprob entries")
        if any(not 0 <= e < m or ep.loss_mask[e] != 1 for e in ep.turn_ends):
            raise RuntimeError(f"episode {i}: a turn ends on a token the policy did not sample ({ep.turn_ends})")
        want = ep.prompt_ids + ep.token_ids
        if ids[i][: n + m] != want:
            j = next(j for j, (a, b) in enumerate(zip(ids[i], want)) if a != b)
            raise RuntimeError(f"episode {i}: the batch trains token id {ids[i][j]} at position {j} but the "
                               f"rollout produced {want[j]}; trained ids must equal the sampled ids")
        want_mask = [0.0] * (n - 1) + [float(x) for x in ep.loss_mask]
        want_mask += [0.0] * (len(mask[i]) - len(want_mask))
        if mask[i] != want_mask:
            j = next(j for j, (a, b) in enumerate(zip(mask[i], want_mask)) if a != b)
            raise RuntimeError(f"episode {i}: loss_mask is {mask[i][j]} at position {j} but should be 1 on "
                               f"exactly the sampled tokens ({want_mask[j]} there)")


def mask_infra_failures(episodes: list[Episode], batch: TokenBatch) -> int:
    """Zero the loss mask of every episode that failed outside the policy (Episode.infra_failure): no policy,
    value or KL term reaches it. Returns how many. Call after check_batch (which compares masks to episodes)."""
    failed = [i for i, ep in enumerate(episodes) if ep.infra_failure]
    if failed:
        batch.loss_mask[failed] = 0.0
    return len(failed)


def default_pad_token(tokenizer) -> None:
    """pad = eos where the tokenizer has no pad token: agentrl's masks never come from pad ids (padding is 0 in
    attention_mask and loss_mask), so which id pads never matters."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def checkpoint_activations(lm, peft: bool = False) -> None:
    """Activation (gradient) checkpointing on every decoder layer, non-reentrant: the reentrant form needs an input
    that requires grad, which frozen embeddings under LoRA are not. peft: also make the embeddings' output require
    grad, as peft's own recipe does."""
    # transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if peft:
        lm.enable_input_require_grads()


def logprob_mismatch(recomputed: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                     threshold: float | None) -> dict[str, float]:
    """|recomputed - sampled| logprobs over sampled tokens, (B, T-1) each: the trainer's forward at the
    rollout's weights must reproduce the sampler's numbers. An error when the mean exceeds `threshold`
    (a temperature, position or padding mismatch shifts every token; numerical noise stays far below)."""
    diff = (recomputed.float() - sampled.float()).abs() * mask
    n = mask.sum().clamp(min=1)
    stats = {"rollout/logprob_mismatch_max": diff.max().item(), "rollout/logprob_mismatch_mean": (diff.sum() / n).item()}
    if threshold is not None and not stats["rollout/logprob_mismatch_mean"] <= threshold:
        raise RuntimeError(f"the trainer's logprobs at the rollout's weights differ from the sampler's by "
                           f"{stats['rollout/logprob_mismatch_mean']:.4g} on average (max "
                           f"{stats['rollout/logprob_mismatch_max']:.4g}), above logprob_mismatch_threshold="
                           f"{threshold}: the update would not train the policy that sampled")
    return stats


def eval_mode(model: torch.nn.Module) -> torch.nn.Module:
    """model.eval() (dropout off, as the trainers want it), except that layers with gradient checkpointing
    enabled keep their own `training` flag on: transformers checkpoints a layer only while it is training,
    so plain eval() would silently turn checkpointing off. Only the flag of the layer itself is set, not its
    children's, so dropout inside stays off; without gradients (rollouts, no_grad forwards) nothing changes."""
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True and hasattr(module, "_gradient_checkpointing_func"):
            module.training = True
    return model


def grads_finite(model: torch.nn.Module) -> bool:
    """True when every gradient is finite (one device sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def guarded_step(accelerator, model: torch.nn.Module, optimizer, loss: torch.Tensor,
                 max_grad_norm: float | None) -> int:
    """Backward, clip and optimizer step that never applies a non-finite update (the caller zeroes the gradients).

    A non-finite loss is not backpropagated; non-finite gradients (checked where accelerate syncs them) are
    dropped, so that step changes nothing. Returns how many non-finite events it met (0-2), for
    `train/skipped_nonfinite`.
    """
    nonfinite = 0
    finite = bool(torch.isfinite(loss))
    if accelerator.num_processes > 1:
        # Every rank must take the same branch: a rank that skipped backward would leave the others waiting
        # in DDP's gradient all-reduce.
        finite = all_finite(accelerator, finite)
    if finite:
        accelerator.backward(loss)
    else:
        nonfinite += 1
    if accelerator.sync_gradients and not all_finite(accelerator, grads_finite(model)):  # FSDP: per-shard check
        nonfinite += 1
        optimizer.zero_grad(set_to_none=True)  # no gradient left: the step changes nothing
    if accelerator.sync_gradients and max_grad_norm:  # None or 0: no clipping (transformers' Trainer's 0)
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return nonfinite


def trainer_state(trainer, **extra) -> dict:
    """The state every trainer checkpoints: trainable weights, optimizer, step, RNGs, task position, log size.

    Called on every process (gathering weights under FSDP / ZeRO-3 is collective); the main process writes it.
    """
    from agentrl.checkpoint import file_size, rng_state, trainable_state

    from agentrl.distributed import sharded

    accelerator = trainer.accelerator
    cycler = getattr(trainer, "cycler", None)
    # One process or DDP: every rank holds the whole model and the same optimizer state.
    model = None if sharded(accelerator) else trainable_state(accelerator.unwrap_model(trainer.model))
    if accelerator.num_processes == 1:
        optimizer, rng = trainer.optimizer.state_dict(), rng_state()
    else:
        model, optimizer, rng = _distributed_state(trainer, model)
    return {"model": model, "optimizer": optimizer, "accelerator_step": accelerator.step,
            "current_step": trainer.current_step, "rng": rng,
            "cycler": cycler.state_dict() if cycler is not None else None,
            "metrics_bytes": file_size(trainer.metrics_log.path),
            "samples_bytes": file_size(getattr(getattr(trainer, "samples_log", None), "path", None)), **extra}


def _trainable_names(accelerator, model) -> list[str]:
    """Names of the trainable parameters as the unwrapped model's state_dict spells them (FSDP's wrapper
    prefixes removed)."""
    from agentrl.distributed import unwrapped_name

    return [unwrapped_name(n) for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad]


def _distributed_state(trainer, model: dict | None) -> tuple[dict, dict, object]:
    """(trainable weights, optimizer state, RNG states of every rank) of a multi-process run.

    Weights (`model`, None when sharded): accelerator.get_state_dict gathers the full tensors under FSDP and
    ZeRO-3 (a collective; under ZeRO-3 it needs `stage3_gather_16bit_weights_on_model_save: true`, which the
    shipped config sets); the value-head model's state_dict may spell LM keys without "pretrained_model.". The
    optimizer: under DDP every rank holds the same state; under FSDP torch's get_optimizer_state_dict gathers
    the full one; under DeepSpeed the engine owns it and it is not checkpointed (resume restarts the moments).
    RNGs: each rank's own (they were seeded differently), so a resumed run continues every rank's stream.
    """
    from accelerate.utils import DistributedType, gather_object

    from agentrl.checkpoint import rng_state
    from agentrl.distributed import gathered_state_dict

    accelerator = trainer.accelerator
    if model is None:
        full = gathered_state_dict(accelerator, trainer.model) or {}
        model = {}
        for n in _trainable_names(accelerator, trainer.model):
            key = n if n in full else n.removeprefix("pretrained_model.")
            if key in full:
                model[n] = full[key]
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # cpu_offload copies the gathered state to the CPU with .cpu(), a no-op on the CPU: torch 2.13 then hands
        # back every state of a parameter as one reused buffer (exp_avg == exp_avg_sq; fsdp/_optim_utils.py,
        # _gather_all_orig_param_state), so on the CPU the state is gathered without it.
        offload = accelerator.device.type != "cpu"
        # Before the first step there is no state, and torch would make one with a zero-gradient step that
        # still counts (Adam's bias correction would then start at step 2): nothing is stored instead.
        optimizer = get_optimizer_state_dict(trainer.model, trainer.optimizer.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=offload)
                                             ) if trainer.optimizer.optimizer.state else None
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        optimizer = None
    else:
        optimizer = trainer.optimizer.state_dict()
    return model, optimizer, {"ranks": gather_object([rng_state()])}


def scalars(row: dict) -> dict:
    """The numbers and strings of a stats row (distributions such as objective/kl_dist are arrays)."""
    import numpy as np

    return {k: v for k, v in row.items() if not isinstance(v, (np.ndarray, torch.Tensor, list, tuple))}


def end_of_step(trainer, stats: dict, episodes: list[Episode], sampled: list[Episode], rollout_seconds: float,
                sync_seconds: float | None, history: list, callback, checkpointer, bar, last: bool, postfix) -> None:
    """What follows every agent-loop step's update, in order: the environment's metrics over the `sampled`
    episodes and the rollout's times join `stats`; the metrics row (its numbers and strings), the update's
    episodes to the samples log, the caller's callback, a checkpoint, the progress bar (postfix(stats))."""
    from agentrl.rollout.engine import episode_metrics

    stats.update(mean_over_processes(trainer.accelerator, episode_metrics(sampled)))
    stats["time/rollout"] = rollout_seconds
    if sync_seconds is not None:
        stats["time/weight_sync"] = sync_seconds
    history.append(stats)
    trainer.metrics_log.write(scalars(stats), trainer.current_step)
    trainer.samples_log.write(trainer.current_step, episodes, trainer._sample_tensors)
    if callback is not None:
        callback(trainer.current_step, stats)
    if checkpointer is not None:
        checkpointer.after_step(trainer, trainer.current_step, stats, last=last)
    if bar is not None:
        bar.set_postfix(**postfix(stats))
        bar.update(1)


def save_trainer_checkpoint(trainer, directory: str) -> None:
    """trainer.state_dict() as a checkpoint (agentrl.checkpoint: atomic, with a manifest) at its current step."""
    from agentrl.checkpoint import write_checkpoint

    write_checkpoint(directory, {"trainer": trainer.state_dict()}, trainer.current_step)


def load_trainer_checkpoint(trainer, directory: str) -> None:
    from agentrl.checkpoint import read_checkpoint

    trainer.load_state_dict(read_checkpoint(directory)["trainer"])


def save_weights(accelerator, model, directory: str, write: Callable[[str, dict | None], None]) -> None:
    """Every process calls it: the weights are gathered (FSDP / ZeRO-3), the main process refuses non-finite ones
    and has `write(tmp_dir, gathered state dict or None)` fill a directory that then replaces `directory`
    atomically; the others wait for it."""
    from agentrl.checkpoint import save_atomically
    from agentrl.distributed import gathered_state_dict

    full = gathered_state_dict(accelerator, model)  # FSDP / ZeRO-3: every rank takes part
    if not accelerator.is_main_process:  # several processes: the main one writes
        accelerator.wait_for_everyone()
        return
    if full is None:
        finite_or_raise(accelerator.unwrap_model(model))
    elif not all(torch.isfinite(v).all() for v in full.values() if v.is_floating_point()):
        raise RuntimeError("refusing to save: non-finite values in the gathered weights")
    save_atomically(directory, lambda tmp: write(tmp, full))
    accelerator.wait_for_everyone()


def write_lm(lm, tmp: str, full: dict | None, tokenizer=None) -> None:
    """save_pretrained of a causal LM or PeftModel (the gathered `full` state dict when given), and the
    tokenizer when given (a full model directory is only loadable with it)."""
    from agentrl.distributed import fsdp_free_names

    with fsdp_free_names(lm):
        lm.save_pretrained(tmp, **({} if full is None else {"state_dict": full}))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def load_trainer_state(trainer, state: dict) -> None:
    """Inverse of trainer_state (on every process); the task position and log size are applied when train()
    starts."""
    from accelerate.utils import DistributedType

    from agentrl.checkpoint import CheckpointError, load_trainable, set_rng_state

    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from agentrl.distributed import load_full_parameters

        options = StateDictOptions(full_state_dict=True, strict=False)
        load_full_parameters(accelerator, trainer.model, state["model"])
        if state["optimizer"] is not None:  # None: saved before the first step
            set_optimizer_state_dict(trainer.model, trainer.optimizer.optimizer, state["optimizer"], options=options)
    elif kind == DistributedType.DEEPSPEED:
        raise CheckpointError("resuming under DeepSpeed is not supported: agentrl checkpoints hold gathered weights "
                              "but not DeepSpeed's optimizer partitions; resume with DDP or FSDP, or start fresh")
    else:
        load_trainable(accelerator.unwrap_model(trainer.model), state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    accelerator.step = state["accelerator_step"]
    trainer.current_step = state["current_step"]
    rng = state["rng"]
    if "ranks" in rng:  # written by a multi-process run: each rank takes its own stream
        if len(rng["ranks"]) != accelerator.num_processes:
            raise CheckpointError(f"the checkpoint was written by {len(rng['ranks'])} processes, this run has "
                                  f"{accelerator.num_processes}; resume with the same number of processes")
        rng = rng["ranks"][accelerator.process_index]
    elif accelerator.num_processes > 1:
        raise CheckpointError(f"the checkpoint was written by 1 process, this run has {accelerator.num_processes}; "
                              "resume with the same number of processes")
    set_rng_state(rng)
    trainer.resumed = {"cycler": state["cycler"], "metrics_bytes": state["metrics_bytes"]}


def resumed_cycler(trainer, tasks: list[dict], seed: int) -> "TaskCycler":
    """The task cycler of train(): fresh, or at the position of the checkpoint the trainer was loaded from."""
    trainer.cycler = TaskCycler(tasks, seed)
    saved = (getattr(trainer, "resumed", None) or {}).pop("cycler", None)
    if saved is not None:
        trainer.cycler.load_state_dict(saved)
    return trainer.cycler


def resumed_metrics(trainer, path: str | None) -> "MetricsLog":
    """The metrics log of train(): emptied, or cut back to the rows the loaded checkpoint had seen."""
    if not path:
        return trainer.metrics_log
    resumed = getattr(trainer, "resumed", None) or {}
    return MetricsLog(path, trainer.accelerator, resumed.pop("metrics_bytes", None))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (B, T, V), input_ids (B, T) -> logprobs (B, T-1) of tokens 1..T-1 under logits / temperature.

    Dividing by the sampling temperature here, for old, new and reference logprobs alike, keeps the
    ratio and the KL about the distribution that was actually sampled (Huang et al. 2024).
    """
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


# Positions per block through the LM head in `response_logprobs`: a (LOGPROB_CHUNK, V) block at a time, so a
# (B, T, V) logits tensor never exists (at Qwen's 152 K vocabulary one 1024-position block is 0.6 GB in fp32).
LOGPROB_CHUNK = 1024
# ... and at most this many logits a block (128 MB in fp32): at V = 151,936 blocks of 220 positions. Measured on a
# DPO step of 16 pairs at that V: same time as blocks of 1024 (12.05 vs 12.31 CPU s, interleaved), and peak RSS
# of the process 2.5 -> 2.0 GB.
LOGPROB_BLOCK_LOGITS = 1 << 25
# Above this many logits in a step (positions x V), each block's logits are recomputed in the backward pass
# rather than kept (activation checkpointing of the head): memory O(chunk x V) instead of O(positions x V).
RECOMPUTE_HEAD_ABOVE = 1 << 25
_HEAD_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _head_block(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias, temperature: float,
                with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, H), targets (N,) -> logprobs (N,) of the targets and entropy (N,) (zeros unless asked;
    detached unless `entropy_grad`: an entropy bonus needs its gradient, a logged statistic does not)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # (N, V)
    if temperature != 1.0:  # at T = 1 (DPO, most RL) no pass over (N, V) and no second (N, V) block: same numbers
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, lse - (torch.softmax(logits, -1) * logits).sum(-1)


def _output_head(lm, batch: TokenBatch, positions: dict) -> torch.nn.Linear | None:
    """The LM's output projection when logits == head(last hidden state) for this model (checked once per model
    on one row of the first batch: true of Llama, Qwen, Mistral, GPT-2, ...; false with logit soft-capping or
    scaling), else None. The checked model must not be wrapped for distributed training (its hooks live in
    its forward)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if base in _HEAD_OK:
        return _HEAD_OK[base]
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    ok = isinstance(head, torch.nn.Linear) and "logits_to_keep" in inspect.signature(base.forward).parameters
    if ok:
        # In full precision whatever the caller's autocast: a model that accelerate prepared for mixed precision
        # autocasts inside its own forward, so a bf16 forward checked against an fp32 head(...) here would fail
        # the check and turn these fast paths off for the whole run (measured: DPO with bf16=True before).
        with torch.no_grad(), torch.autocast(batch.input_ids.device.type, enabled=False):
            row = {k: v[:1] for k, v in positions.items()}
            out = base(input_ids=batch.input_ids[:1], attention_mask=batch.attention_mask[:1],
                       output_hidden_states=True, **row)
            ok = torch.allclose(head(out.hidden_states[-1]).float(), out.logits.float(), rtol=1e-4, atol=1e-4)
    _HEAD_OK[base] = head if ok else None
    return _HEAD_OK[base]


def _no_logits(lm, device) -> dict:
    """The forward kwarg that makes the model's own LM head run on no position at all (the fast paths read its
    last hidden states and apply the head themselves): `logits_to_keep` as an empty index tensor where the model
    takes one (sampling.index_logits_to_keep), else 1. `logits_to_keep=1` is not free at a real vocabulary:
    see sampling.index_logits_to_keep."""
    if index_logits_to_keep(lm, device):
        return {"logits_to_keep": torch.empty(0, dtype=torch.long, device=device)}
    return {"logits_to_keep": 1}


def response_logprobs(model, batch: TokenBatch, temperature: float, with_entropy: bool = False,
                      value_head: torch.nn.Module | None = None, entropy_grad: bool = False):
    """Logprobs of tokens 1..T-1 computed only where `batch.loss_mask` (B, T-1) is 1: the last hidden states of
    those positions go through the LM head, LOGPROB_CHUNK at a time, and a logsumexp and a gather give each
    token's logprob, so neither logits nor log-softmax of shape (B, T, V) is built (decisive at real vocabulary
    sizes; the prompt, tool-output and padding positions cost nothing after the last layer).

    model: a causal LM (or PeftModel). value_head: PPO's, read on the same hidden states.
    Returns (logprobs, entropy or None, values or None), each (B, T-1), 0 where loss_mask is 0; or None when the
    model's logits are not its head applied to its last hidden state (then use the full forward).
    """
    from agentrl.models.value_head import accepts_position_ids

    positions = {"position_ids": position_ids(batch.attention_mask)} if accepts_position_ids(model) else {}
    head = _output_head(model, batch, positions)
    if head is None:
        return None
    # The model's own head runs on no position (_no_logits): we read the last hidden states instead.
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                **_no_logits(model, batch.input_ids.device), **positions)
    hidden = out.hidden_states[-1][:, :-1]  # (B, T-1, H): position t predicts token t+1
    where = batch.loss_mask.bool()
    logprobs, entropy = _head_logprobs(head, hidden, where, batch.input_ids[:, 1:], temperature, with_entropy,
                                       entropy_grad, (*torch.nonzero(where, as_tuple=True), where.shape))
    values = None
    if value_head is not None:
        values = value_head(hidden.to(value_head.summary.weight.device)).float() * batch.loss_mask
    return logprobs, entropy, values


def _head_logprobs(head, hidden, where, targets, temperature, with_entropy, entropy_grad, put):
    """The LM head, LOGPROB_CHUNK positions (at most LOGPROB_BLOCK_LOGITS logits) at a time, then logsumexp and
    gather, at hidden[where] for targets[where]; the N results go into zeros of shape put[2] at indices
    (put[0], put[1]).
    Returns (logprobs, entropy or None) of that shape."""
    picked, targets = hidden[where], targets[where]  # (N, H), (N,)
    recompute = torch.is_grad_enabled() and picked.shape[0] * head.out_features > RECOMPUTE_HEAD_ABOVE
    parts, block = [], max(1, min(LOGPROB_CHUNK, LOGPROB_BLOCK_LOGITS // head.out_features))
    for s in range(0, picked.shape[0], block):
        args = (picked[s:s + block], targets[s:s + block], head.weight, head.bias, temperature,
                with_entropy, entropy_grad)
        parts.append(torch.utils.checkpoint.checkpoint(_head_block, *args, use_reentrant=False) if recompute
                     else _head_block(*args))

    def scatter(values: list[torch.Tensor]) -> torch.Tensor:
        full = torch.zeros(put[2], dtype=torch.float32, device=hidden.device)
        if not values:  # nothing sampled: still a graph, so a backward of a zero loss works as before
            return full + hidden.sum() * 0.0 if hidden.requires_grad else full
        return full.index_put(put[:2], torch.cat(values))

    return scatter([p[0] for p in parts]), (scatter([p[1] for p in parts]) if with_entropy else None)


def shared_prefix_logprobs(model, batch: TokenBatch, temperature: float, with_entropy: bool = False,
                           entropy_grad: bool = False, rest_min_saving: float | None = None):
    """`response_logprobs` for batches whose rows share prefixes (GRPO's groups: one prompt, num_generations
    episodes; DPO's pairs: one prompt, chosen and rejected): each distinct prefix (the ids before a row's first
    sampled token) runs once, its KV cache is copied to the rows that share it, and only the rest of each row
    runs on top of it. The same maths as one forward over the whole rows (gradients reach the prefix through
    the cache); the prompt's FLOPs are paid once per group instead of once per row. rest_min_saving: see
    rests_on_prefixes (None: LogprobPaths' default).

    Returns (logprobs, entropy or None, None) like response_logprobs, or None where there is little to share
    (fewer than two rows per prefix on average), a row has no sampled token, or the model's head cannot be
    split off (then use response_logprobs / the full forward).
    """
    from transformers import DynamicCache

    from agentrl.models.value_head import accepts_position_ids
    from agentrl.rollout.sampling import cache_kwarg

    mask, ids = batch.loss_mask, batch.input_ids
    B = ids.shape[0]
    if B < 2 or not bool(mask.bool().any(-1).all()) or not accepts_position_ids(model):
        return None
    first = mask.float().argmax(-1) + 1  # (B,) index of each row's first sampled token
    first_list = first.tolist()
    rows = ids.tolist()
    prefixes: dict[tuple, int] = {}
    row_map = [prefixes.setdefault(tuple(rows[i][: first_list[i]]), len(prefixes)) for i in range(B)]
    if 2 * len(prefixes) > B:
        return None
    positions = {"position_ids": position_ids(batch.attention_mask)}
    head = _output_head(model, batch, positions)
    if head is None:
        return None
    device, pad = ids.device, 0
    # Prefixes, left-padded: (U, Lp); their last column predicts each row's first sampled token.
    width = max(len(p) for p in prefixes)
    prefix_ids = torch.full((len(prefixes), width), pad, dtype=torch.long, device=device)
    prefix_mask = torch.zeros_like(prefix_ids)
    for u, p in enumerate(prefixes):
        prefix_ids[u, width - len(p):] = torch.tensor(p, device=device)
        prefix_mask[u, width - len(p):] = 1
    cache = DynamicCache()
    kw = cache_kwarg(model)
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids(prefix_mask),
                use_cache=True, output_hidden_states=True, **_no_logits(model, device), **{kw: cache})
    if cache.get_seq_length() != width:  # the model kept no cache (gradient checkpointing turns it off)
        return None
    rm = torch.tensor(row_map, device=device)
    last = out.hidden_states[-1][:, -1][rm]  # (B, H)
    rest = (batch.attention_mask.sum(-1) - first).clamp(min=0)  # (B,) each row's tokens after its prefix
    saving = FAST.rest_min_saving if rest_min_saving is None else rest_min_saving
    return rests_on_prefixes(model, kw, head, batch, cache, rm, prefix_mask, last, first, rest, temperature,
                             with_entropy, entropy_grad, rest_min_saving=saving)


def rests_on_prefixes(model, kw, head, batch: TokenBatch, cache, rm, prefix_mask, last, first, rest, temperature,
                      with_entropy, entropy_grad, value_head=None, rest_min_saving: float | None = None,
                      buckets: int = 2, best: bool = False):
    """The second part of the prefix-sharing paths: each row's rest on top of its prefix's KV (`cache` holds one
    entry per prefix, `rm` (B,) says which prefix each row has; `last` (B, H), `first` and `rest` (B,) are the
    rows' own). Rows whose rests differ in length (DPO's chosen and rejected, an agent's episodes of one turn and
    of three) run in groups by rest length (up to `buckets`, chosen as length_groups does with `best`), each on its
    own copy of its rows' prefix caches, when that cuts the rest's padded positions by at least `rest_min_saving`
    (None: one forward): the same numbers per row, fewer positions.
    Returns (logprobs, entropy or None, values or None), each (B, T-1)."""
    from transformers import DynamicCache

    B = len(rm)
    groups = length_groups(rest, rest_min_saving, buckets, best) if rest_min_saving is not None and B >= 4 else None
    if groups is None:  # one forward over every row's rest
        cache.batch_select_indices(rm)  # (U, ...) -> (B, ...): differentiable indexing of each layer's K and V
        return _rest_logprobs(model, kw, head, batch, torch.arange(B, device=rm.device), cache, prefix_mask[rm],
                              last, first, rest, temperature, with_entropy, entropy_grad, value_head)
    totals = [None, None, None]  # logprobs, entropy, values: disjoint rows, zeros elsewhere
    for g in groups:
        cache_g = DynamicCache(ddp_cache_data=[(layer.keys[rm[g]], layer.values[rm[g]]) for layer in cache.layers])
        parts = _rest_logprobs(model, kw, head, batch, g, cache_g, prefix_mask[rm[g]], last[g], first[g], rest[g],
                               temperature, with_entropy, entropy_grad, value_head)
        totals = [part if total is None or part is None else total + part for total, part in zip(totals, parts)]
    return tuple(totals)


def _rest_logprobs(model, kw, head, batch: TokenBatch, rows, cache, prefix_mask, last, first, rest, temperature,
                   with_entropy, entropy_grad, value_head=None):
    """shared_prefix_logprobs' second part for `rows` (indices into the batch): the rest of each of those rows,
    right-padded, on top of `cache` (their prefixes' KV, one per row); (logprobs, entropy, values or None), (B, T-1)
    with zeros outside `rows` (values: `value_head` on the same hidden states). first, rest, last, prefix_mask:
    those rows' own."""
    mask, ids = batch.loss_mask, batch.input_ids[rows]
    Ls = int(rest.max())
    arange = torch.arange(Ls, device=ids.device)
    valid = arange[None] < rest[:, None]  # (R, Ls)
    take = (first[:, None] + arange[None]).clamp(max=ids.shape[1] - 1)
    rest_ids = torch.where(valid, ids.gather(1, take), torch.full_like(take, 0))
    out = model(input_ids=rest_ids, attention_mask=torch.cat([prefix_mask, valid.long()], 1),
                position_ids=first[:, None] + arange[None], use_cache=True, output_hidden_states=True,
                **_no_logits(model, ids.device), **{kw: cache})
    # Column j predicts token first + j: the prefix's last hidden state, then the rest's (its last column
    # predicts nothing).
    hidden = torch.cat([last[:, None], out.hidden_states[-1][:, :-1]], 1)  # (R, Ls, H)
    shifted = mask[rows].gather(1, (first[:, None] - 1 + arange[None]).clamp(max=mask.shape[1] - 1)).bool() & valid
    r, j = torch.nonzero(shifted, as_tuple=True)
    put = (rows[r], first[r] - 1 + j, mask.shape)
    logprobs, entropy = _head_logprobs(head, hidden, shifted, rest_ids, temperature, with_entropy, entropy_grad, put)
    values = None
    if value_head is not None:
        picked = value_head(hidden[shifted].to(value_head.summary.weight.device)).float()  # (N,)
        values = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device).index_put(put[:2], picked)
    return logprobs, entropy, values


def common_prefix_logprobs(model, batch: TokenBatch, temperature: float, with_entropy: bool = False,
                           entropy_grad: bool = False, value_head: torch.nn.Module | None = None,
                           min_saving: float = 0.25, rest_min_saving: float | None = None, rest_buckets: int = 3):
    """`response_logprobs` for a batch whose rows all begin with the same tokens: an agent's episodes share the
    system message, the tool schemas and the chat markers, often most of each row (a chat-template prompt with
    one tool is ~190 of ~220 tokens). That common prefix runs once as a batch of one, its KV cache is expanded
    to every row, and only the rest of each row runs on top of it. The same maths as one forward over the whole
    rows (gradients reach the prefix through the cache). value_head: PPO's, read on the same hidden states.
    rest_min_saving, rest_buckets: the rests run in up to `rest_buckets` groups by length, cut where they pad
    least, when that saves this fraction of their positions (rests_on_prefixes; None: one forward).

    Returns (logprobs, entropy or None, values or None), each (B, T-1), or None when the prefix would save less
    than `min_saving` of the batch's positions, a row has no sampled token, or the model's head cannot be split
    off (then use response_logprobs / the full forward).
    """
    from transformers import DynamicCache

    from agentrl.models.value_head import accepts_position_ids
    from agentrl.rollout.sampling import cache_kwarg

    mask, ids = batch.loss_mask, batch.input_ids
    B = ids.shape[0]
    if B < 2 or not bool(mask.bool().any(-1).all()) or not accepts_position_ids(model):
        return None
    lengths = batch.attention_mask.sum(-1)
    first = mask.float().argmax(-1) + 1  # (B,) index of each row's first sampled token
    same = (ids == ids[:1]).all(0).long().cumprod(0)  # 1 up to the first column where some row differs
    P = min(int(same.sum()), int(first.min()))  # the prefix ends at or before every row's first sampled token
    if P < 2 or (B - 1) * P < min_saving * int(lengths.sum()):
        return None
    positions = {"position_ids": position_ids(batch.attention_mask)}
    head = _output_head(model, batch, positions)
    if head is None:
        return None
    device = ids.device
    cache, kw = DynamicCache(), cache_kwarg(model)
    prefix_mask = torch.ones((1, P), dtype=batch.attention_mask.dtype, device=device)
    out = model(input_ids=ids[:1, :P], attention_mask=prefix_mask, position_ids=torch.arange(P, device=device)[None],
                use_cache=True, output_hidden_states=True, **_no_logits(model, device), **{kw: cache})
    if cache.get_seq_length() != P:  # the model kept no cache (gradient checkpointing turns it off)
        return None
    last = out.hidden_states[-1][:, -1].expand(B, -1)  # (B, H): predicts each row's token P
    return rests_on_prefixes(model, kw, head, batch, cache, torch.zeros(B, dtype=torch.long, device=device),
                             prefix_mask, last, torch.full((B,), P, device=device), lengths - P, temperature,
                             with_entropy, entropy_grad, value_head, rest_min_saving, rest_buckets, best=True)


def prefix_groups(batch: TokenBatch) -> list[tuple[torch.Tensor, int]]:
    """The batch's rows cut into groups that share a prefix, chosen to skip the most positions: [(rows, P)], where
    the P first tokens of every row in `rows` are the same and end at or before each row's first trained token.
    Rows are sorted by their prompts' ids, so rows sharing a prefix are neighbours, and a run of sorted rows shares
    what its first and last rows share. Among the cuts of that order into runs, a dynamic programme picks the one
    that maximises the sum of (len(run) - 1) x P: each run's prefix runs once instead of len(run) times. A batch
    mixing two kinds of rows (an agent's demonstrations, which share a long system message and tool schemas, and
    general instructions under another system message) gets a group of each; a row that shares nothing comes back
    alone with P = 0."""
    ids, mask = batch.input_ids.tolist(), batch.loss_mask.bool()
    B = len(ids)
    first = (mask.float().argmax(-1) + 1).tolist()  # each row's first trained token (the end of its prompt)
    prompts = [ids[i][: first[i]] if bool(mask[i].any()) else [] for i in range(B)]
    order = sorted(range(B), key=lambda i: prompts[i])

    def shared(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    # best[k]: the most positions saved over the first k sorted rows; its last run is order[start[k]:k] sharing P[k].
    best, start, P = [0] * (B + 1), list(range(-1, B)), [0] * (B + 1)
    for k in range(1, B + 1):
        best[k] = best[k - 1]
        for j in range(k - 2, -1, -1):  # the run order[j:k]; sharing only shrinks as j goes down
            common = shared(prompts[order[j]], prompts[order[k - 1]])
            if common == 0:
                break
            if best[j] + (k - j - 1) * common > best[k]:
                best[k], start[k], P[k] = best[j] + (k - j - 1) * common, j, common
    groups, k = [], B
    while k > 0:
        groups.append((torch.tensor(sorted(order[start[k]:k]), device=batch.input_ids.device), P[k]))
        k = start[k]
    return groups[::-1]


@dataclass(frozen=True)
class LogprobPaths:
    """The exact shortcuts of the logprob functions, all on by default; each gives the numbers of one full forward
    up to float rounding. A trainer's `logprob_paths`; benchmarks/levers.py switches one off to measure it.

    response_only: the LM head only where a row trains (response_logprobs), not full (B, T, V) logits.
    shared_prefix: prompts that rows share run once (shared_prefix_logprobs for GRPO groups and DPO pairs).
    bucket_min_saving: rows of similar length forward apart (by_length) when that cuts the padded positions by at
      least this fraction (above 1: never).
    rest_min_saving: the same for the rests after a shared prefix (rests_on_prefixes). Lower than
      bucket_min_saving: the prefix is not run again for the second group.
    rest_buckets: how many groups the rests after a common prefix may run in, cut where they pad least
      (common_prefix_logprobs: PPO's batches, SFT's prefix groups); GRPO's and DPO's run in two of equal size.
    """

    response_only: bool = True
    shared_prefix: bool = True
    bucket_min_saving: float = 0.25
    rest_min_saving: float = 0.1
    rest_buckets: int = 3


FAST = LogprobPaths()


def length_groups(lengths: torch.Tensor, min_saving: float, buckets: int = 2,
                  best: bool = False) -> list[torch.Tensor] | None:
    """Row indices in `buckets` groups of similar `lengths` (shortest first), or None when padding each group
    to its own longest row would not cut the padded positions by at least `min_saving`. The groups hold equal
    numbers of rows, or with `best` the cut of the sorted rows into at most `buckets` runs with the fewest padded
    positions (an agent's batch of many short episodes and a few long ones: the long ones alone), each run after
    the first saving `min_saving` more."""
    order = torch.argsort(lengths)
    if best:
        groups = [order[a:b] for a, b in fewest_padded_runs(lengths[order].tolist(), buckets, min_saving)]
    else:
        groups = [g for g in torch.tensor_split(order, buckets) if len(g)]
    padded = lengths.numel() * int(lengths.max())
    if len(groups) < 2 or sum(len(g) * int(lengths[g].max()) for g in groups) > (1 - min_saving) * padded:
        return None
    return groups


def fewest_padded_runs(lengths: list[int], most: int, min_gain: float = 0.0) -> list[tuple[int, int]]:
    """The cut of ascending `lengths` into at most `most` runs [(start, end)] that minimises the sum over runs of
    len(run) x its last (longest) length: a small dynamic programme, O(most x n^2) for n rows. Each run costs a
    forward of its own, so one more run is taken only while it cuts the padded positions by at least `min_gain`
    (a fraction) against one fewer."""
    n = len(lengths)
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(most + 1)]  # cost[k][j]: the first j rows in k runs
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    cost[0][0] = 0
    for k in range(1, most + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):  # the last run is rows i..j-1
                c = cost[k - 1][i] + (j - i) * lengths[j - 1]
                if c < cost[k][j]:
                    cost[k][j], cut[k][j] = c, i
    k = 1
    while k < min(most, n) and cost[k + 1][n] < (1 - min_gain) * cost[k][n] and cost[k + 1][n] < cost[k][n]:
        k += 1
    runs, j = [], n
    while k:
        runs.append((cut[k][j], j))
        j, k = cut[k][j], k - 1
    return runs[::-1]


def by_length(forward, batch: TokenBatch, buckets: int = 2, min_saving: float = FAST.bucket_min_saving):
    """forward(batch) -> tuple of (B, T-1) tensors (or None), run on `buckets` groups of rows of similar length
    and put back in row order, when that saves at least `min_saving` of the padded positions: a mini-batch mixing
    20- and 70-token episodes no longer pays 70 positions for each. Rows are independent in a causal LM
    forward, so the numbers are those of one forward (up to float rounding); gradients flow through the
    reassembly."""
    groups = length_groups(batch.attention_mask.sum(-1), min_saving, buckets)
    if groups is None:
        return forward(batch)
    outs = [forward(batch.select(g)) for g in groups]
    shape = batch.loss_mask.shape

    def assemble(parts):
        if parts[0] is None:
            return None
        full = torch.zeros(shape, dtype=parts[0].dtype, device=parts[0].device)
        for g, x in zip(groups, parts):
            full = full.index_put((g[:, None], torch.arange(x.shape[1], device=x.device)[None]), x)
        return full

    return tuple(assemble([o[k] for o in outs]) for k in range(len(outs[0])))


def masked_logprobs(model, batch: TokenBatch, temperature: float, with_entropy: bool = False,
                    paths: LogprobPaths = FAST):
    """(logprobs, entropy or None), each (B, T-1), at the positions where batch.loss_mask is 1 (0 elsewhere),
    by the cheapest exact path `paths` allows: shared prefixes run once (shared_prefix_logprobs), else the LM
    head only at those positions (response_logprobs), else the full forward. The entropy is a detached statistic."""
    # A model wrapped for several processes (DDP, FSDP, DeepSpeed) must run its own forward, where its
    # gradient hooks live: the full forward.
    wrapped = type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")
    out = None
    if not wrapped and paths.response_only and paths.shared_prefix:
        out = shared_prefix_logprobs(model, batch, temperature, with_entropy, rest_min_saving=paths.rest_min_saving)
    if out is None and not wrapped and paths.response_only:
        out = response_logprobs(model, batch, temperature, with_entropy)
    if out is not None:
        return out[0], out[1]
    logprobs, logits = lm_logprobs(model, batch, temperature, return_logits=True)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits[:, :-1].float() / temperature) * batch.loss_mask
    return logprobs * batch.loss_mask, entropy


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

    def __init__(self, path: str | Path | None, accelerator=None, resume_bytes: int | None = None):
        main = accelerator is None or accelerator.is_main_process  # several processes: the main one writes
        self.path = Path(path) if path and main else None
        self.accelerator = accelerator
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_bytes is None:
                self.path.write_text("")
            else:  # resumed: drop the rows (and any half row) written after the checkpoint
                from agentrl.checkpoint import truncate_to

                truncate_to(self.path, resume_bytes)

    def write(self, row: dict, step: int | None = None) -> None:
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        if self.path:
            with self.path.open("a") as f:  # strict JSON: a non-finite number is written as null
                f.write(strict_json(row if step is None else {"step": step, **row}) + "\n")


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

    def state_dict(self) -> dict:
        return {"order": list(self.order), "rng": self.rng.getstate(), "num_tasks": len(self.tasks)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_tasks"] != len(self.tasks):
            raise ValueError(f"the checkpoint's task cycler had {state['num_tasks']} tasks, this run has "
                             f"{len(self.tasks)}; resume with the same env.tasks and env.train_tasks")
        self.order, self.rng = list(state["order"]), random.Random()
        self.rng.setstate(state["rng"])


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


def check_log_with(log_with: str | None) -> None:
    """`log_with` names one of accelerate's trackers (accelerate's own error is a traceback at trainer set-up)."""
    from accelerate.utils import LoggerType

    from agentrl.errors import UserError

    known = [t.value for t in LoggerType]
    if log_with is not None and log_with not in known:
        raise UserError(f"log_with: {log_with!r} is not one of accelerate's trackers ({', '.join(known)}), or None")
