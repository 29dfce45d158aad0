"""PPO for tool-using agents, with TRL 0.11's API: PPOConfig, PPOTrainer.generate/.step/.log_stats.

Read top to bottom: config, trainer set-up (one backbone: policy + value head + adapter-disabled
reference), the classic `generate`/`step` API, the agent-level `train()` over an environment, and the
update itself (`_update`: old/ref logprobs -> KL-shaped rewards -> GAE -> clipped epochs -> stats).
Maths lives in `agentrl.algos`; rollouts in `agentrl.rollout`.
"""

from __future__ import annotations

import copy
import contextlib
import math
import re
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from agentrl.algos import AdaptiveKLController, FixedKLController, gae, kl_penalty, masked_mean, masked_var, whiten
from agentrl.algos.losses import ppo_policy_loss, ppo_value_loss
from agentrl.models.value_head import AutoModelForCausalLMWithValueHead
from agentrl.rollout.engine import Episode, episode_metrics, rollout
from agentrl.rollout.sampling import SamplingParams, sample_batch
from agentrl.samples import SamplesLog
from agentrl.trainers.common import (MetricsLog, TokenBatch, build_batch, check_batch, episodes_to_batch,
                                     finite_or_raise, grads_finite, lm_logprobs, load_trainer_state, logprob_mismatch,
                                     policy_forward, progress_bar, resumed_cycler, resumed_metrics, trainer_state)


@dataclass
class PPOConfig:
    """Every field of TRL 0.11's PPOConfig, with its defaults, plus a few agentrl additions at the end."""

    exp_name: str = "ppo"  # experiment name, used for trackers
    seed: int = 0  # random seed
    log_with: str | None = None  # tracker for accelerate: "wandb", "tensorboard", ... (None: no tracker)
    task_name: str | None = None  # free-form task name, recorded with the trackers
    model_name: str | None = None  # the model's name or path, recorded with the trackers
    query_dataset: str | None = None  # the dataset's name, recorded with the trackers
    reward_model: str | None = None  # the reward model's name, recorded with the trackers
    remove_unused_columns: bool = True  # drop dataset columns the collator does not need (kept for parity)
    tracker_kwargs: dict = field(default_factory=dict)  # passed to init_trackers(init_kwargs=...)
    accelerator_kwargs: dict = field(default_factory=dict)  # passed to Accelerator(...)
    project_kwargs: dict = field(default_factory=dict)  # passed to accelerate's ProjectConfiguration
    tracker_project_name: str = "trl"  # project name for the trackers
    push_to_hub_if_best_kwargs: dict = field(default_factory=dict)  # accepted for parity; nothing is pushed
    steps: int = 20000  # number of PPO steps (agent-level train() default)
    learning_rate: float = 1.41e-5  # Adam learning rate
    adap_kl_ctrl: bool = True  # adaptive KL coefficient (Ziegler et al. 2019)
    init_kl_coef: float = 0.2  # initial KL coefficient
    kl_penalty: Literal["kl", "abs", "mse", "full"] = "kl"  # per-token KL estimator for reward shaping
    target: float = 6.0  # target KL for the adaptive controller
    horizon: float = 10000.0  # horizon of the adaptive controller
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # policy ratio clip
    cliprange_value: float = 0.2  # value clip
    vf_coef: float = 0.1  # value loss coefficient
    batch_size: int = 128  # episodes per PPO step
    forward_batch_size: int | None = None  # deprecated in TRL 0.11; no-grad forwards use mini_batch_size
    mini_batch_size: int = 128  # episodes per optimisation step
    gradient_accumulation_steps: int = 1  # mini-batches per optimizer step
    world_size: int | None = None  # set from accelerate
    ppo_epochs: int = 4  # optimisation epochs per batch
    max_grad_norm: float | None = None  # gradient-norm clip (None: off)
    optimize_cuda_cache: bool | None = None  # deprecated in TRL 0.11; accepted, no effect
    optimize_device_cache: bool = False  # accepted for parity; no effect
    early_stopping: bool = False  # stop the epochs when policy KL > 1.5 * target_kl
    target_kl: float = 1.0  # KL target for early stopping
    compare_steps: int = 1  # accepted for parity (push_to_hub_if_best); no effect
    ratio_threshold: float = 10.0  # skip a mini-batch whose mean ratio exceeds this
    use_score_scaling: bool = False  # divide scores by their running std
    use_score_norm: bool = False  # with use_score_scaling, also subtract the running mean
    score_clip: float | None = None  # clip scores to [-score_clip, score_clip]
    whiten_rewards: bool = False  # whiten per-token rewards before GAE
    gradient_checkpointing: bool = False  # gradient checkpointing on the backbone
    is_encoder_decoder: bool | None = None  # set from the model; encoder-decoders are not supported
    is_peft_model: bool | None = None  # set from the model
    backward_batch_size: int | None = None  # derived: mini_batch_size * gradient_accumulation_steps
    global_backward_batch_size: int | None = None  # derived
    global_batch_size: int | None = None  # derived
    dataset_num_proc: int | None = None  # processes for dataset.map when tokenizing queries
    # --- agentrl additions ---
    temperature: float = 1.0  # sampling temperature; logits are divided by it wherever logprobs are computed
    adam_eps: float = 1e-8  # Adam epsilon (TRL's default; 1e-5 is often steadier, Huang et al. 2024)
    whiten_advantages: bool = True  # whiten advantages over the mask (TRL always does)
    entropy_coef: float = 0.0  # entropy bonus (usually 0)
    value_head_init_std: float = 0.0  # value head init: 0 = zeros
    missing_eos_penalty: float | None = None  # subtracted from the score of episodes cut by max_new_tokens
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"  # accelerate's mixed precision
    project_dir: str | None = None  # where trackers write (tensorboard logs)
    logprob_mismatch_threshold: float | None = 0.05  # error when the mean |recomputed - sampled| logprob at
    # the rollout's weights exceeds this (None: only logged as rollout/logprob_mismatch_*)

    def __post_init__(self):
        if self.kl_penalty not in ("kl", "abs", "mse", "full"):
            raise ValueError(f"kl_penalty must be one of kl, abs, mse, full; got {self.kl_penalty!r}")
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        backward = self.mini_batch_size * self.gradient_accumulation_steps
        if backward > self.batch_size and self.batch_size % self.mini_batch_size == 0:
            # Seed 000 asks for batch_size=1, mini_batch_size=1, gradient_accumulation_steps=4, which TRL
            # 0.11 rejected. One step cannot accumulate over more mini-batches than it has.
            fitted = self.batch_size // self.mini_batch_size
            warnings.warn(f"gradient_accumulation_steps={self.gradient_accumulation_steps} needs "
                          f"{backward} episodes per step but batch_size={self.batch_size}; using "
                          f"gradient_accumulation_steps={fitted}", stacklevel=3)
            self.gradient_accumulation_steps = fitted
            backward = self.mini_batch_size * fitted
        if self.batch_size % backward:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of mini_batch_size * "
                             f"gradient_accumulation_steps ({self.mini_batch_size} * {self.gradient_accumulation_steps})")
        self.backward_batch_size = backward
        self.world_size = self.world_size or 1
        self.global_backward_batch_size = backward * self.world_size
        self.global_batch_size = self.batch_size * self.world_size


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


def _collate(rows: list[dict]) -> dict[str, list]:
    """Dict of lists, as TRL 0.11's collator: `batch["input_ids"]` is a list of 1-D tensors."""
    out = {key: [row[key] for row in rows] for key in rows[0]}
    if "input_ids" in out:
        out["input_ids"] = [torch.as_tensor(x, dtype=torch.long) for x in out["input_ids"]]
    return out


class PPOTrainer:
    """PPO with a value head on the policy's own backbone.

    model: a causal LM, a `PeftModel` (as the tutorials make with `get_peft_model`), or an
    `AutoModelForCausalLMWithValueHead`. Under LoRA the reference is the adapter-disabled backbone and no
    second model exists; for full fine-tuning, `ref_model` or else a frozen copy is the reference.
    """

    def __init__(self, config: PPOConfig | None = None, model=None, ref_model=None, tokenizer=None, dataset=None,
                 optimizer: torch.optim.Optimizer | None = None, data_collator: Callable | None = None,
                 num_shared_layers: int | None = None, lr_scheduler=None, training_data_collator=None):
        self.config = config = config or PPOConfig()
        if model is None or tokenizer is None:
            raise ValueError("PPOTrainer needs `model` and `tokenizer`")
        if num_shared_layers is not None:
            warnings.warn("num_shared_layers is ignored: the reference shares every layer (adapter disabled) "
                          "under LoRA, or is a full frozen copy", stacklevel=2)
        set_seed(config.seed)
        self.accelerator = Accelerator(gradient_accumulation_steps=config.gradient_accumulation_steps,
                                       mixed_precision=config.mixed_precision, log_with=config.log_with,
                                       project_dir=config.project_dir, **config.accelerator_kwargs)
        config.world_size = self.accelerator.num_processes
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError("encoder-decoder models are not supported; use a causal LM")
        if not isinstance(model, AutoModelForCausalLMWithValueHead):
            model = AutoModelForCausalLMWithValueHead(model, v_head_init_std=config.value_head_init_std)
        self.is_peft_model = config.is_peft_model = model.is_peft_model
        config.is_encoder_decoder = False
        if ref_model is not None:
            ref = ref_model.pretrained_model if isinstance(ref_model, AutoModelForCausalLMWithValueHead) else ref_model
            self.ref_model = ref.eval().requires_grad_(False)
        elif self.is_peft_model:
            self.ref_model = None  # the adapter-disabled backbone
        else:
            self.ref_model = copy.deepcopy(model.pretrained_model).eval().requires_grad_(False)
        if config.gradient_checkpointing:
            lm = model.pretrained_model
            # transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable
            if hasattr(lm, "activation_checkpointing_enable"):
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.is_peft_model:
                model.pretrained_model.enable_input_require_grads()

        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            # Our masks never infer anything from pad ids, so pad == eos is safe here.
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; the policy could never end an episode")

        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = optimizer or torch.optim.Adam(params, lr=config.learning_rate, eps=config.adam_eps)
        self.lr_scheduler = lr_scheduler
        self.dataset = self._prepare_dataset(dataset) if dataset is not None else None
        self.dataloader = None
        if self.dataset is not None:
            self.dataloader = torch.utils.data.DataLoader(self.dataset, batch_size=config.batch_size, shuffle=True,
                                                          collate_fn=data_collator or _collate, drop_last=True)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        if self.dataloader is not None:
            self.dataloader = self.accelerator.prepare(self.dataloader)
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)
        self.kl_ctl = (AdaptiveKLController(config.init_kl_coef, config.target, config.horizon) if config.adap_kl_ctrl
                       else FixedKLController(config.init_kl_coef))
        self.running = RunningMoments()
        self.current_step = 0
        self.metrics_log = MetricsLog(None, self.accelerator)
        self.samples_log = SamplesLog(None)  # a job sets SamplesLog(run_dir/"samples.jsonl", ...) to sample episodes
        self._sample_tensors: dict = {}  # the last update's per-token tensors, for samples_log
        if config.log_with:
            self.accelerator.init_trackers(config.tracker_project_name, config=_flat_config(config),
                                           init_kwargs=config.tracker_kwargs)
        # Dropout off everywhere, during rollouts and updates alike (Huang et al. 2024).
        self.model.eval()

    # --- the classic TRL 0.11 API ----------------------------------------------------------------------

    def _prepare_dataset(self, dataset):
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "input_ids" not in columns:
            if "query" not in columns:
                raise ValueError(f"the dataset needs an 'input_ids' or a 'query' column; it has {columns}")
            dataset = dataset.map(lambda row: {"input_ids": self.tokenizer(row["query"])["input_ids"]},
                                  num_proc=self.config.dataset_num_proc)
        return dataset

    @property
    def policy(self):
        """The causal LM being trained (a PeftModel under LoRA), unwrapped from accelerate."""
        return self.accelerator.unwrap_model(self.model).pretrained_model

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

        def run(model):
            out = []
            for start in range(0, len(contexts), chunk):
                samples = sample_batch(model, contexts[start:start + chunk], params, eos, self.tokenizer.pad_token_id,
                                       tokenizer=self.tokenizer, stop_patterns=stops)
                out += [torch.tensor((c if return_prompt else []) + s.ids, dtype=torch.long, device=q.device)
                        for c, s, q in zip(contexts[start:start + chunk], samples, queries[start:start + chunk])]
            return out

        responses = run(self.policy)
        if generate_ref_response:
            with self._reference():
                ref_responses = run(self.ref_model or self.policy)
            return (responses[0], ref_responses[0]) if single else (responses, ref_responses)
        return responses[0] if single else responses

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores: list,
             response_masks: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One PPO step on `batch_size` (query, response, score) triples; returns the stats dict.

        response_masks: optional 0/1 tensors over each response, 0 on tokens the policy did not write
        (tool outputs pasted into the response); those tokens get no loss, KL or advantage.
        """
        n = self.config.batch_size
        for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
            if len(value) != n:
                raise ValueError(f"batch size ({n}) does not match number of {name} ({len(value)})")
        if response_masks is not None and len(response_masks) != n:
            raise ValueError(f"batch size ({n}) does not match number of response_masks ({len(response_masks)})")
        score_values = []
        for i, s in enumerate(scores):
            s = torch.as_tensor(s, dtype=torch.float32)
            if s.numel() != 1:
                raise ValueError(f"scores[{i}] must be a scalar, got shape {tuple(s.shape)}")
            score_values.append(float(s))
        score_values = self._scale_scores(torch.tensor(score_values)).tolist()
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
        return self._update(build_batch(rows, self.tokenizer.pad_token_id))

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send the stats (plus reward mean/std) to the trackers and the metrics file."""
        rewards = torch.tensor([float(torch.as_tensor(r)) for r in rewards])
        row = dict(stats)
        row["env/reward_mean"], row["env/reward_std"] = rewards.mean().item(), rewards.std(unbiased=False).item()
        self.metrics_log.write(row, self.current_step)

    def _scale_scores(self, scores: torch.Tensor) -> torch.Tensor:
        if self.config.use_score_scaling:
            self.running.update(scores)
            scores = (scores - self.running.mean) / self.running.std if self.config.use_score_norm else \
                scores / self.running.std
        if self.config.score_clip is not None:
            scores = scores.clamp(-self.config.score_clip, self.config.score_clip)
        return scores

    # --- the agent-level loop --------------------------------------------------------------------------

    def train(self, env_factory: Callable, tasks: list[dict], steps: int | None = None,
              sampling: SamplingParams | None = None, metrics_path: str | None = None,
              callback: Callable[[int, dict], None] | None = None, progress: bool = True,
              score_hook: Callable[[list[Episode]], None] | None = None, checkpointer=None) -> list[dict]:
        """Run `steps` PPO steps of `batch_size` episodes each on tasks drawn from `tasks`.

        env_factory: a class or callable returning a fresh environment (see agentrl.envs.base). Only the
        prompt the environment builds reaches the model; the task's answer stays with the environment.
        checkpointer: an agentrl.checkpoint.Checkpointer (periodic checkpoints, signals, non-finite streaks).
        After load_checkpoint, train() continues the task order and the metrics file of the checkpoint.
        """
        steps = self.config.steps if steps is None else steps
        sampling = sampling or SamplingParams(temperature=self.config.temperature)
        if abs(sampling.temperature - self.config.temperature) > 1e-9:
            raise ValueError(f"sampling temperature {sampling.temperature} != PPOConfig.temperature "
                             f"{self.config.temperature}; logprobs must be computed at the sampling temperature")
        self.metrics_log = resumed_metrics(self, metrics_path)
        cycler, history = resumed_cycler(self, tasks, self.config.seed), []
        bar = progress_bar(steps, "PPO", progress)
        for i in range(steps):
            batch_tasks = cycler.draw(self.config.batch_size)
            started = time.time()
            episodes = rollout(self.policy, self.tokenizer, env_factory, batch_tasks, sampling)
            if score_hook is not None:  # e.g. reward models adding to the environment's scores
                score_hook(episodes)
            rollout_seconds = time.time() - started
            batch = episodes_to_batch(episodes, self.tokenizer.pad_token_id, self.config.missing_eos_penalty)
            check_batch(episodes, batch)
            stats = self._update(batch)
            stats.update(episode_metrics(episodes))
            stats["time/rollout"] = rollout_seconds
            self.metrics_log.write(stats, self.current_step)
            self.samples_log.write(self.current_step, episodes, self._sample_tensors)
            history.append(stats)
            if callback is not None:
                callback(self.current_step, stats)
            if checkpointer is not None:
                checkpointer.after_step(self, self.current_step, stats, last=i == steps - 1)
            if bar is not None:
                bar.set_postfix(score=f"{stats['ppo/mean_scores']:.2f}", acc=f"{stats['env/accuracy']:.2f}",
                                kl=f"{stats['objective/kl']:.3f}")
                bar.update(1)
        if bar is not None:
            bar.close()
        return history

    # --- the update ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _old_and_ref(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """No-grad forwards in mini-batch chunks: (old_logprobs, values, ref_logprobs, kl), each (B, T-1)."""
        T, kind = self.config.temperature, self.config.kl_penalty
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for start in range(0, len(batch), self.config.mini_batch_size):
            chunk = batch.select(torch.arange(start, min(start + self.config.mini_batch_size, len(batch))))
            pad = batch.loss_mask.shape[1] - chunk.loss_mask.shape[1]
            with self.accelerator.autocast():
                logp, v, _, logits = policy_forward(self.model, chunk, T)
                with self._reference():
                    ref_logp, ref_logits = lm_logprobs(self.ref_model or self.policy, chunk, T, return_logits=True)
            kl = kl_penalty(logp, ref_logp, kind, logits[:, :-1] / T, ref_logits[:, :-1] / T)
            for out, x in zip(parts, (logp, v, ref_logp, kl)):
                out.append(torch.nn.functional.pad(x, (0, pad)))
        return tuple(torch.cat(p) for p in parts)

    def _reference(self):
        if self.ref_model is None:
            return self.accelerator.unwrap_model(self.model).adapter_disabled()
        return contextlib.nullcontext()

    def _update(self, batch: TokenBatch) -> dict[str, float]:
        cfg, t0 = self.config, time.time()
        self.model.eval()  # dropout off, whatever the caller did to the model in between
        batch = batch.to(self.accelerator.device)
        mask = batch.loss_mask  # (B, T-1): 1 on sampled tokens only; prompt, tool output, padding are 0
        old_logprobs, values, ref_logprobs, kl = self._old_and_ref(batch)
        mismatch = {} if batch.logprobs is None else logprob_mismatch(old_logprobs, batch.logprobs, mask,
                                                                      cfg.logprob_mismatch_threshold)
        t_forward = time.time()

        # Per-token rewards: -beta * KL at every action token, plus each turn's score at its last token.
        kl = kl * mask
        non_score_rewards = -self.kl_ctl.value * kl
        rewards = non_score_rewards + batch.scores
        if cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        t_rewards = time.time()
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        advantages, returns = advantages.detach(), returns.detach()
        self._sample_tensors = {"trainer_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
                                "advantages": advantages, "values": values}
        t_adv = time.time()

        acc = defaultdict(list)
        skipped = nonfinite = 0
        for _epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(len(batch))
            epoch_kl = []
            for start in range(0, len(batch), cfg.mini_batch_size):
                idx = perm[start:start + cfg.mini_batch_size]
                mb = batch.select(idx)
                w = mb.loss_mask.shape[1]
                mb_old, mb_values, mb_adv, mb_ret = (x[idx, :w] for x in (old_logprobs, values, advantages, returns))
                with self.accelerator.accumulate(self.model):
                    with self.accelerator.autocast():
                        logprobs, vpred, entropy, _ = policy_forward(self.model, mb, cfg.temperature, with_entropy=True)
                    pg_loss, pg_stats = ppo_policy_loss(logprobs, mb_old, mb_adv, mb.loss_mask, cfg.cliprange)
                    vf_loss, vf_stats = ppo_value_loss(vpred, mb_values, mb_ret, mb.loss_mask, cfg.cliprange_value)
                    mean_entropy = masked_mean(entropy, mb.loss_mask)
                    loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * mean_entropy
                    if pg_stats["ratio"] > cfg.ratio_threshold:
                        loss, skipped = loss * 0.0, skipped + 1  # TRL 0.11: the mini-batch is skipped
                    if torch.isfinite(loss):
                        self.accelerator.backward(loss)
                    else:  # a non-finite loss is never backpropagated: its update is skipped
                        nonfinite += 1
                    if self.accelerator.sync_gradients and not grads_finite(self.model):
                        nonfinite += 1
                        self.optimizer.zero_grad(set_to_none=True)  # no gradient left: the step changes nothing
                    if self.accelerator.sync_gradients and cfg.max_grad_norm is not None:
                        self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                acc["ppo/loss/policy"].append(pg_loss.item())
                acc["ppo/loss/value"].append(vf_loss.item())
                acc["ppo/loss/total"].append(loss.item())
                acc["ppo/policy/entropy"].append(mean_entropy.item())
                for k in ("approxkl", "policykl", "clipfrac", "k3kl"):
                    acc[f"ppo/policy/{k}"].append(pg_stats[k].item())
                acc["ppo/policy/ratio"].append(pg_stats["ratio"].item())
                acc["ppo/val/clipfrac"].append(vf_stats["clipfrac"].item())
                acc["ppo/val/vpred"].append(masked_mean(vpred, mb.loss_mask).item())
                acc["ppo/val/error"].append(masked_mean((vpred - mb_ret).square(), mb.loss_mask).item())
                epoch_kl.append(pg_stats["policykl"].item())
            if cfg.early_stopping and sum(epoch_kl) / len(epoch_kl) > 1.5 * cfg.target_kl:
                break
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        t_opt = time.time()

        seq_kl = kl.sum(-1)  # (B,) KL summed over each episode's action tokens
        stats = {k: sum(v) / len(v) for k, v in acc.items()}
        explained = 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)
        stats.update({
            "objective/kl": seq_kl.mean().item(),
            "objective/kl_coef": self.kl_ctl.value,
            "objective/logprobs": masked_mean(old_logprobs, mask).item(),
            "objective/ref_logprobs": masked_mean(ref_logprobs, mask).item(),
            "objective/entropy": (-old_logprobs * mask).sum(-1).mean().item(),
            "ppo/mean_scores": batch.scores.sum(-1).mean().item(),
            "ppo/std_scores": batch.scores.sum(-1).std(unbiased=False).item(),
            "ppo/mean_non_score_reward": non_score_rewards.sum(-1).mean().item(),
            "ppo/returns/mean": masked_mean(returns, mask).item(),
            "ppo/returns/var": masked_var(returns, mask).item(),
            "ppo/val/mean": masked_mean(values, mask).item(),
            "ppo/val/var_explained": explained.item(),
            "ppo/policy/advantages_mean": masked_mean(advantages, mask).item(),
            "ppo/learning_rate": self.optimizer.param_groups[0]["lr"],
            "ppo/skipped_minibatches": float(skipped),
            "train/skipped_nonfinite": float(nonfinite),
            "tokens/responses_len_mean": mask.sum(-1).mean().item(),
            "time/ppo/forward_pass": t_forward - t0,
            "time/ppo/compute_rewards": t_rewards - t_forward,
            "time/ppo/compute_advantages": t_adv - t_rewards,
            "time/ppo/optimize_step": t_opt - t_adv,
            "time/ppo/total": time.time() - t0,
            **mismatch,
        })
        self.kl_ctl.update(stats["objective/kl"], cfg.batch_size * cfg.world_size)
        self.current_step += 1
        return stats

    # --- checkpoints (agentrl.checkpoint) ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (weights, optimizer, KL controller, RNGs, ...)."""
        return trainer_state(self, kl_ctl=vars(self.kl_ctl), running=vars(self.running),
                             lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler else None)

    def load_state_dict(self, state: dict) -> None:
        load_trainer_state(self, state)
        vars(self.kl_ctl).update(state["kl_ctl"])
        vars(self.running).update(state["running"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def save_checkpoint(self, directory: str) -> None:
        from agentrl.checkpoint import write_checkpoint

        write_checkpoint(directory, {"trainer": self.state_dict()}, self.current_step)

    def load_checkpoint(self, directory: str) -> None:
        from agentrl.checkpoint import read_checkpoint

        self.load_state_dict(read_checkpoint(directory)["trainer"])

    def save_pretrained(self, save_directory: str) -> None:
        """Write the policy (adapter under LoRA) and the value head, atomically, refusing non-finite weights."""
        from agentrl.checkpoint import save_atomically

        model = self.accelerator.unwrap_model(self.model)
        finite_or_raise(model)
        def write(tmp: str) -> None:
            model.save_pretrained(tmp)
            if not self.is_peft_model:  # a full model directory is only loadable with its tokenizer
                self.tokenizer.save_pretrained(tmp)

        save_atomically(save_directory, write)


def _flat_config(config: PPOConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(config).items() if isinstance(v, (int, float, str, bool)) or v is None}
