"""TRL 0.11's PPO API over agentrl's agent PPO: scripts written for `trl.PPOTrainer` run with `agentrl`.

`PPOTrainer` here is agentrl.trainers.ppo.PPOTrainer (the agent loop, `train()`, and the update) plus what only a
TRL 0.11 script uses: a dataset and its dataloader, `generate` (with the sampler's logprobs kept for `step`),
`step` on hand-made (query, response, score) triples, score scaling, `log_stats`, and the public pieces TRL
exposed (`prepare_model_inputs`, `batched_forward_pass`, `compute_rewards`). `step` builds the same token batch
the agent loop builds and runs the same `_update`.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from agentrl import core
from agentrl.algos import kl_penalty, kl_shaped_rewards
from agentrl.models.value_head import AutoModelForCausalLMWithValueHead
from agentrl.precision import frozen_casts_cached
from agentrl.rollout.sampling import SamplingParams, sample_batch
from agentrl.trainers import ppo
from agentrl.trainers.common import TokenBatch, build_batch, position_ids, scalars

__all__ = ["PPOConfig", "PPOTrainer"]


@dataclass
class PPOConfig(ppo.PPOConfig):
    """TRL 0.11's PPOConfig: the agent PPO's settings plus the fields only TRL's sample-by-hand API reads or
    that TRL 0.11 accepted without using them, with TRL's defaults (every field of TRL 0.11.4's PPOConfig)."""

    exp_name: str = field(default_factory=lambda: os.path.basename(sys.argv[0])[: -len(".py")])  # the script's name
    task_name: str | None = None  # free-form task name, recorded with the trackers
    model_name: str | None = "gpt2"  # the model's name or path (TRL's examples load it; recorded with the trackers)
    query_dataset: str | None = "stanfordnlp/imdb"  # the dataset's name (TRL's examples load it)
    reward_model: str | None = "sentiment-analysis:lvwerra/distilbert-imdb"  # "task:model" (TRL's examples)
    remove_unused_columns: bool = True  # drop dataset columns the collator does not need
    dataset_num_proc: int | None = None  # processes for dataset.map when tokenizing queries
    use_score_scaling: bool = False  # step(): divide scores by their running std
    use_score_norm: bool = False  # step(): with use_score_scaling, also subtract the running mean
    score_clip: float | None = None  # step(): clip scores to [-score_clip, score_clip]
    forward_batch_size: int | None = None  # deprecated in TRL 0.11: overrides mini_batch_size
    push_to_hub_if_best_kwargs: dict = field(default_factory=dict)  # accepted; nothing is pushed
    compare_steps: int = 1  # accepted (push_to_hub_if_best); no effect
    optimize_cuda_cache: bool | None = None  # deprecated in TRL 0.11; accepted, no effect
    optimize_device_cache: bool = False  # accepted; no effect (PyTorch's caching allocator does this job)

    def __post_init__(self):
        if self.forward_batch_size is not None:
            warnings.warn("Note that using `forward_batch_size` is deprecated, use `mini_batch_size` instead. By "
                          "setting it you overwrite `mini_batch_size`.", stacklevel=3)
            self.mini_batch_size = self.forward_batch_size
        super().__post_init__()
        self.total_ppo_epochs = int(math.ceil(self.steps / self.batch_size))  # TRL's examples stop at this

    @classmethod
    def of(cls, config: ppo.PPOConfig | None) -> PPOConfig:
        """`config` as this class: an agent PPOConfig gets TRL's defaults for the fields it lacks."""
        if config is None or isinstance(config, cls):
            return config or cls()
        return cls(**{f.name: getattr(config, f.name) for f in fields(ppo.PPOConfig) if f.init})


class RunningMoments:
    """Running mean/std of scores (Chan et al. parallel update), for use_score_scaling."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        n = xs.numel()
        batch_mean, batch_var = xs.mean().item(), xs.var(unbiased=False).item()
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / max(self.count - 1, 1)) if self.count > 1 else 1.0


_GENERATE_KWARGS = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_length", "min_new_tokens",
                    "pad_token_id", "eos_token_id", "stop_strings", "use_cache", "batch_size"}


def _collate(rows: list) -> dict[str, list]:
    """Dict rows -> dict of lists, as TRL 0.11's example collator: `batch["input_ids"]` is a list of 1-D tensors.
    Any other rows (tuples, tensors) get torch's default collation, as TRL 0.11 gives them without a collator."""
    from collections.abc import Mapping

    if not isinstance(rows[0], Mapping):
        return torch.utils.data.default_collate(rows)
    out = {key: [row[key] for row in rows] for key in rows[0]}
    if "input_ids" in out:
        out["input_ids"] = [torch.as_tensor(x, dtype=torch.long) for x in out["input_ids"]]
    return out


def _loggable(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


class PPOTrainer(ppo.PPOTrainer):
    """TRL 0.11's PPOTrainer: the agent trainer, plus `dataset` / `data_collator` / `training_data_collator` and
    the sample-by-hand API. Arguments as TRL 0.11's."""

    def __init__(self, config: PPOConfig | None = None, model=None, ref_model=None, tokenizer=None, dataset=None,
                 optimizer: torch.optim.Optimizer | None = None, data_collator: Callable | None = None,
                 num_shared_layers: int | None = None, lr_scheduler=None, training_data_collator=None):
        config = PPOConfig.of(config)
        super().__init__(config, model, ref_model, tokenizer, optimizer=optimizer,
                         num_shared_layers=num_shared_layers, lr_scheduler=lr_scheduler)
        if dataset is None:
            warnings.warn("No dataset is provided. Make sure to set config.batch_size to the correct value before "
                          "training.", UserWarning, stacklevel=2)
        self.dataset = self._prepare_dataset(dataset) if dataset is not None else None
        self.dataloader = None
        if self.dataset is not None:
            self.dataloader = self.accelerator.prepare(self.prepare_dataloader(self.dataset, data_collator))
        # The collator of prepare_model_inputs (TRL's training_data_collator): pads query+response ids.
        from transformers import DataCollatorForLanguageModeling

        self.data_collator = training_data_collator or DataCollatorForLanguageModeling(tokenizer, mlm=False)
        self.running = RunningMoments()  # of the scores given to step(), for use_score_scaling
        # The sampler's logprobs and values of what generate() returned at this step, for step() to reuse.
        self._generated: dict[tuple, tuple[list[float], list[float]]] = {}
        self._generated_at = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "running": vars(self.running)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        vars(self.running).update(state["running"])

    def _prepare_dataset(self, dataset):
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "input_ids" not in columns:
            if "query" not in columns:
                raise ValueError(f"the dataset needs an 'input_ids' or a 'query' column; it has {columns}")
            dataset = dataset.map(lambda row: {"input_ids": self.tokenizer(row["query"])["input_ids"]},
                                  num_proc=self.config.dataset_num_proc)
        return dataset

    def prepare_dataloader(self, dataset, data_collator=None) -> torch.utils.data.DataLoader:
        """Shuffled batches of `batch_size`, the last incomplete one dropped (TRL 0.11). A `datasets.Dataset`
        keeps only the columns the model's forward takes plus label, query and response (remove_unused_columns).
        """
        columns = getattr(dataset, "column_names", None)
        if columns is not None and self.config.remove_unused_columns and hasattr(dataset, "remove_columns"):
            keep = set(inspect.signature(AutoModelForCausalLMWithValueHead.forward).parameters) | {
                "input_ids", "attention_mask", "label", "query", "response"}
            dataset = dataset.remove_columns([c for c in columns if c not in keep])
        return torch.utils.data.DataLoader(dataset, batch_size=self.config.batch_size, shuffle=True,
                                           collate_fn=data_collator or _collate, drop_last=True)

    def _scale_scores(self, scores: torch.Tensor) -> torch.Tensor:
        if self.config.use_score_scaling:
            self.running.update(scores)
            scores = (scores - self.running.mean) / self.running.std if self.config.use_score_norm else \
                scores / self.running.std
        if self.config.score_clip is not None:
            scores = scores.clamp(-self.config.score_clip, self.config.score_clip)
        return scores

    def _sampling_params(self, kwargs: dict) -> tuple[SamplingParams, int, tuple[str, ...], int]:
        unknown = set(kwargs) - _GENERATE_KWARGS
        if unknown:
            raise ValueError(f"unsupported generation kwargs {sorted(unknown)}; supported: {sorted(_GENERATE_KWARGS)}")
        if kwargs.get("min_length", -1) not in (-1, 0, None):
            raise ValueError("min_length > 0 is not supported; use min_new_tokens")
        temperature = float(kwargs.get("temperature", self.config.temperature))
        if abs(temperature - self.config.temperature) > 1e-9:
            warnings.warn(f"sampling at temperature {temperature} but PPOConfig.temperature is "
                          f"{self.config.temperature}: the PPO ratio will be computed at the config's", stacklevel=3)
        params = SamplingParams(max_new_tokens=int(kwargs.get("max_new_tokens", 32)), temperature=temperature,
                                top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p", 1.0)),
                                do_sample=bool(kwargs.get("do_sample", True)),
                                min_new_tokens=int(kwargs.get("min_new_tokens", 0)))
        stop_strings = kwargs.get("stop_strings") or []
        stops = tuple(re.escape(s) for s in ([stop_strings] if isinstance(stop_strings, str) else stop_strings))
        eos = kwargs.get("eos_token_id", self.tokenizer.eos_token_id)
        return params, int(eos[0] if isinstance(eos, (list, tuple)) else eos), stops, int(kwargs.get("batch_size", 64))

    @torch.no_grad()
    def generate(self, query_tensor, length_sampler=None, batch_size: int = 4, return_prompt: bool = True,
                 generate_ref_response: bool = False, remove_padding: bool = True, **generation_kwargs):
        """Sample responses for one query tensor or a list of them (TRL 0.11 semantics).

        Returns the response (with the prompt when `return_prompt`), each cut after its first EOS;
        with `generate_ref_response`, also the reference model's responses.
        """
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = [query_tensor] if single else list(query_tensor)
        if length_sampler is not None:
            generation_kwargs["max_new_tokens"] = int(length_sampler())
        generation_kwargs.setdefault("batch_size", batch_size)
        params, eos, stops, chunk = self._sampling_params(generation_kwargs)
        contexts = [q.tolist() for q in queries]

        def run(model, value_head=None):
            out = []
            for start in range(0, len(contexts), chunk):
                samples = sample_batch(model, contexts[start:start + chunk], params, eos, self.tokenizer.pad_token_id,
                                       tokenizer=self.tokenizer, stop_patterns=stops, value_head=value_head)
                out += [torch.tensor((c if return_prompt else []) + s.ids, dtype=torch.long, device=q.device)
                        for c, s, q in zip(contexts[start:start + chunk], samples, queries[start:start + chunk])]
                if value_head is not None:  # step() on these very ids, before any update, reuses them
                    self._generated.update({(tuple(c), tuple(s.ids)): (s.logprobs, s.values)
                                            for c, s in zip(contexts[start:start + chunk], samples)})
            return out

        if self._generated_at != self.current_step:  # kept only until the next update
            self._generated, self._generated_at = {}, self.current_step
        # the sampler at the update's precision (mixed_precision), each frozen weight cast once, as in rollout()
        with self.accelerator.autocast(), frozen_casts_cached(self.policy):
            responses = run(self.policy, self._rollout_value_head)
            if generate_ref_response:
                with self._reference():
                    ref_responses = run(self._ref_lm or self.policy)
        if generate_ref_response:
            # A single 1-D query gives a (1, L) tensor, as model.generate does (TRL 0.11).
            return (responses[0][None], ref_responses[0][None]) if single else (responses, ref_responses)
        return responses[0][None] if single else responses

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores: list,
             response_masks: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One PPO step on `batch_size` (query, response, score) triples; returns the stats dict.

        response_masks: optional 0/1 tensors over each response, 0 on tokens the policy did not write
        (tool outputs pasted into the response); those tokens get no loss, KL or advantage.
        """
        queries, responses, scores, response_masks = self._step_safety_checker(
            self.config.batch_size, queries, responses, scores, response_masks)
        score_values = self._scale_scores(torch.stack(scores)).tolist()
        rows = []
        for i, (q, r) in enumerate(zip(queries, responses)):
            q, r = q.tolist(), r.tolist()
            if not r:
                raise ValueError(f"responses[{i}] is empty")
            mask = [1] * len(r) if response_masks is None else [int(x) for x in torch.as_tensor(response_masks[i]).tolist()]
            if len(mask) != len(r):
                raise ValueError(f"response_masks[{i}] has {len(mask)} entries for a response of {len(r)} tokens")
            last = max((j for j, m in enumerate(mask) if m), default=None)
            rewards = [] if last is None else [(len(q) + last, score_values[i])]
            rows.append((q + r, [0] * len(q) + mask, rewards))
        batch = build_batch(rows, self.tokenizer.pad_token_id)
        self._attach_generated(batch, queries, responses, response_masks)
        return self._update(batch)

    def _step_safety_checker(self, batch_size: int, queries: list, responses: list, scores: list,
                             masks: list | None = None) -> tuple[list, list, list[torch.Tensor], list | None]:
        """step()'s input check, under TRL 0.11's name (its tests call it): lists of `batch_size` queries,
        responses and scores (and masks), each score a scalar. Returns them with each score a 0-d float tensor."""
        for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
            if len(value) != batch_size:
                raise ValueError(f"batch size ({batch_size}) does not match number of {name} ({len(value)})")
        if masks is not None and len(masks) != batch_size:
            raise ValueError(f"batch size ({batch_size}) does not match number of response_masks ({len(masks)})")
        checked = []
        for i, s in enumerate(scores):
            s = torch.as_tensor(s, dtype=torch.float32)
            if s.dim() > 1:
                raise ValueError(f"Scores must be 1-dimensional - got {s.dim()} for scores[{i}] = {s}")
            if s.numel() != 1:
                raise ValueError(f"scores[{i}] must be a scalar, got shape {tuple(s.shape)}")
            checked.append(s.reshape(()))
        return list(queries), list(responses), checked, masks

    def _attach_generated(self, batch: TokenBatch, queries, responses, response_masks) -> None:
        """When every (query, response) of this step is exactly what the last generate() sampled, with no update
        since, give the batch the sampler's logprobs and values (reuse_rollout_logprobs: no old forward)."""
        if not self._generated or self._generated_at != self.current_step or response_masks is not None:
            return
        found = [self._generated.get((tuple(q.tolist()), tuple(r.tolist()))) for q, r in zip(queries, responses)]
        if any(f is None for f in found):
            return
        batch.logprobs, batch.values = torch.zeros_like(batch.loss_mask), torch.zeros_like(batch.loss_mask)
        for i, (q, (logprobs, values)) in enumerate(zip(queries, found)):  # token n + k is predicted at n + k - 1
            n = len(q)
            batch.logprobs[i, n - 1: n - 1 + len(logprobs)] = torch.tensor(logprobs, dtype=torch.float)
            batch.values[i, n - 1: n - 1 + len(values)] = torch.tensor(values, dtype=torch.float)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send the stats (plus env/reward_mean, env/reward_std) to the trackers and the metrics file.

        With W&B, `columns_to_log` of `batch` plus the rewards go to a "game_log" table, as in TRL 0.11.
        """
        rewards = torch.tensor([float(torch.as_tensor(r)) for r in rewards])
        if self.config.log_with == "wandb" and any(c not in batch for c in columns_to_log):
            raise ValueError(f"Columns to log {columns_to_log} are not present in the batch {batch.keys()}.")
        if "query" not in batch and "response" not in batch:
            warnings.warn("The game logs will not be logged because the batch does not contain the keys 'query' "
                          "and 'response'. ", stacklevel=2)
        row = dict(stats)
        row["env/reward_mean"], row["env/reward_std"] = rewards.mean().item(), rewards.std(unbiased=False).item()
        row["env/reward_dist"] = rewards.numpy()
        wandb_on = any(getattr(t, "name", None) == "wandb" for t in self.accelerator.trackers)
        if wandb_on and self.accelerator.is_main_process and "query" in batch:
            import wandb

            table = [[_loggable(batch[c][i]) for c in columns_to_log] + [rewards[i].item()]
                     for i in range(len(rewards))]
            self.accelerator.log({"game_log": wandb.Table(columns=[*columns_to_log, "reward"], rows=table)},
                                 step=self.current_step)
        self.metrics_log.write(scalars(row), self.current_step)

    def prepare_model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """query+response ids padded by `self.data_collator` (the tokenizer's padding side): input_ids and
        attention_mask (B, T), on the trainer's device."""
        ids = [torch.cat([q, r]) for q, r in zip(queries, responses)]
        inputs = self.data_collator([{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids])
        inputs.pop("labels", None)  # no LM loss
        return {k: v.to(self.current_device) for k, v in inputs.items()}

    @torch.no_grad()
    def batched_forward_pass(self, model, queries: list[torch.Tensor], responses: list[torch.Tensor],
                             model_inputs: dict, return_logits: bool = False,
                             response_masks: list[torch.Tensor] | None = None):
        """Forward `model_inputs` in chunks of `mini_batch_size`, in eval mode.

        Returns (logprobs, logits or None, values, masks), each over positions 0..T-2 of `model_inputs`
        (position t scores token t+1): logprobs (B, T-1), logits (B, T-1, V), values (B, T-1), masks (B, T-1)
        1 on response tokens (times `response_masks`). Position ids follow the attention mask, so left
        padding does not shift positions. A plain LM (no value head) gives zero values.
        """
        fbs, out = self.config.mini_batch_size, {"logprobs": [], "logits": [], "values": [], "masks": []}
        model.eval()
        for i in range(math.ceil(len(queries) / fbs)):
            chunk = {k: v[i * fbs:(i + 1) * fbs] for k, v in model_inputs.items()}
            ids, attention = chunk["input_ids"], chunk["attention_mask"]
            kwargs = {"position_ids": position_ids(attention)}
            if isinstance(model, AutoModelForCausalLMWithValueHead) or isinstance(
                    self.accelerator.unwrap_model(model), AutoModelForCausalLMWithValueHead):
                logits, _, values = model(**chunk, **kwargs)
            else:
                from agentrl.models.value_head import accepts_position_ids

                logits = model(**chunk, **(kwargs if accepts_position_ids(model) else {})).logits
                values = torch.zeros(ids.shape, device=ids.device)
            logits = logits.float() / self.config.temperature
            masks = torch.zeros_like(attention)
            masks[:, :-1] = attention[:, 1:]
            for j in range(len(ids)):
                start = len(queries[i * fbs + j]) - 1  # the position predicting the first response token
                if attention[j, 0] == 0:  # left padding
                    start += int(attention[j].nonzero()[0])
                end = start + len(responses[i * fbs + j])
                masks[j, :start] = 0
                masks[j, end:] = 0
                if response_masks is not None:
                    masks[j, start:end] = masks[j, start:end] * response_masks[i * fbs + j].to(masks.device)
            out["logprobs"].append(core.logprobs_from_logits(logits[:, :-1], ids[:, 1:]))
            out["logits"].append(logits[:, :-1] if return_logits else None)
            out["values"].append(values[:, :-1].float())
            out["masks"].append(masks[:, :-1])
        return (torch.cat(out["logprobs"]), torch.cat(out["logits"]) if return_logits else None,
                torch.cat(out["values"]), torch.cat(out["masks"]))

    def _kl_penalty(self, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate of `config.kl_penalty`; for "full", the inputs are log-distributions (.., V)."""
        if self.config.kl_penalty == "full":
            return kl_penalty(logprob, ref_logprob, "full", logprob, ref_logprob)
        return kl_penalty(logprob, ref_logprob, self.config.kl_penalty)

    def compute_rewards(self, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                        masks: torch.Tensor):
        """Per-token rewards (B, T): -kl_coef * KL everywhere, plus each row's score at its last mask-1 token.

        scores (B,); logprobs, ref_logprobs (B, T) (or (B, T, V) log-distributions with kl_penalty "full");
        masks (B, T). Returns (rewards, non_score_rewards, kls), each (B, T).
        """
        kls = self._kl_penalty(logprobs, ref_logprobs)
        token_scores = torch.zeros_like(kls)
        for i, (score, mask) in enumerate(zip(scores, masks)):
            token_scores[i, mask.nonzero()[-1]] = score
        rewards, non_score_rewards = kl_shaped_rewards(token_scores, kls, self.kl_ctl.value)
        return rewards, non_score_rewards, kls
