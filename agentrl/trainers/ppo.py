"""PPO for tool-using agents: one backbone serves as policy, value head and (adapter disabled) reference.

Read top to bottom: config, set-up, `train()` (rollout over an environment -> token batch -> `_update`), and
the update itself (`_update`: old/ref logprobs -> KL-shaped rewards -> GAE -> `_optimize`'s clipped epochs ->
stats). Maths lives in `agentrl.algos`; rollouts in `agentrl.rollout`. TRL 0.11's sample-by-hand API
(`generate`, `step`, `batched_forward_pass`, ...) is an adapter over this trainer: `agentrl.trl_compat`.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from accelerate.utils import ProjectConfiguration, set_seed

from agentrl import core
from agentrl.errors import UserError
from agentrl.algos import (AdaptiveKLController, FixedKLController, gae, kl_penalty, kl_shaped_rewards, masked_mean,
                           masked_var, turn_gae, whiten)
from agentrl.algos.losses import entropy_from_logits, ppo_policy_loss, ppo_value_loss, tis_weights
from agentrl.models.value_head import AutoModelForCausalLMWithValueHead, create_reference_model
from agentrl.rollout.engine import Episode, rollout
from agentrl.rollout.sampling import SamplingParams
from agentrl.samples import SamplesLog
from agentrl.trainers.common import (FAST, MetricsLog, TokenBatch, by_length, check_batch, check_log_with,
                                     checkpoint_activations, common_prefix_logprobs, default_pad_token, end_of_step,
                                     episodes_to_batch, eval_mode, gathered_for_generation, global_logprob_mismatch,
                                     global_masked_moments, global_token_scale, guarded_step, lm_logprobs,
                                     load_trainer_checkpoint, load_trainer_state, logprob_mismatch, make_accelerator,
                                     mask_infra_failures, norm_gain_parameters, optimizer_groups, policy_forward,
                                     progress_bar, response_logprobs, resumed_cycler, resumed_metrics,
                                     save_trainer_checkpoint, save_weights, sum_over_processes, trainer_state,
                                     write_lm)
from agentrl.trainers.sft import sft_loss


@dataclass
class PPOConfig:
    """The agent PPO's settings: TRL 0.11's PPOConfig fields that the update reads, with TRL's names and
    defaults, then agentrl's own. The fields only TRL's sample-by-hand API reads (dataset handling, score
    scaling for `step()`, Hub and cache flags) are in `agentrl.trl_compat.PPOConfig`, which adds them to these."""

    seed: int = 0  # random seed
    log_with: str | None = None  # tracker for accelerate: "wandb", "tensorboard", ... (None: no tracker)
    tracker_kwargs: dict = field(default_factory=dict)  # passed to init_trackers(init_kwargs=...)
    accelerator_kwargs: dict = field(default_factory=dict)  # passed to Accelerator(...)
    project_kwargs: dict = field(default_factory=dict)  # passed to accelerate's ProjectConfiguration
    tracker_project_name: str = "trl"  # project name for the trackers
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
    mini_batch_size: int = 128  # episodes per optimisation step
    gradient_accumulation_steps: int = 1  # mini-batches per optimizer step
    world_size: int | None = None  # set from accelerate
    ppo_epochs: int = 4  # optimisation epochs per batch
    max_grad_norm: float | None = None  # gradient-norm clip (None: off)
    early_stopping: bool = False  # stop the epochs when policy KL > 1.5 * target_kl
    target_kl: float = 1.0  # KL target for early stopping
    ratio_threshold: float = 10.0  # skip a mini-batch whose mean ratio exceeds this
    whiten_rewards: bool = False  # whiten per-token rewards before GAE
    gradient_checkpointing: bool = False  # gradient checkpointing on the backbone
    is_encoder_decoder: bool | None = None  # set from the model; encoder-decoders are not supported
    is_peft_model: bool | None = None  # set from the model
    backward_batch_size: int | None = None  # derived: mini_batch_size * gradient_accumulation_steps
    global_backward_batch_size: int | None = None  # derived
    global_batch_size: int | None = None  # derived
    # --- agentrl additions ---
    temperature: float = 1.0  # sampling temperature; logits are divided by it wherever logprobs are computed
    adam_eps: float = 1e-8  # Adam epsilon (TRL's default; 1e-5 is often steadier, Huang et al. 2024)
    whiten_advantages: bool = True  # whiten advantages over the mask (TRL always does)
    entropy_coef: float = 0.0  # entropy bonus (usually 0)
    value_head_init_std: float = 0.0  # value head init: 0 = zeros
    value_learning_rate: float | None = None  # the value head's own learning rate (None: learning_rate), see __init__
    norm_learning_rate: float | None = None  # learning rate of trainable norm gains (None: learning_rate)
    anneal_lr: bool = False  # train(): every rate falls linearly over the run, to 1/steps of itself at the last step
    missing_eos_penalty: float | None = None  # subtracted from the score of episodes cut by max_new_tokens
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = "no"  # accelerate's; auto: bf16 where native
    project_dir: str | None = None  # where trackers write (tensorboard logs)
    ptx_coef: float = 0.0  # PPO-ptx (Ouyang et al. 2022, eq. 2): weight of the SFT loss on demonstrations, 0: off
    ptx_data: str | None = None  # its demonstrations: a JSONL file (trainers/sft.py rows), or "env" in jobs
    logprob_mismatch_threshold: float | None = 0.05  # error when the mean |recomputed - sampled| logprob at
    # the rollout's weights exceeds this (None: only logged as rollout/logprob_mismatch_*)
    reuse_rollout_logprobs: bool = True  # old logprobs and values as the sampler computed them: no separate
    # forward, checked on the first mini-batch (REUSE_TOLERANCE; otherwise, and with kl_penalty "full", forward)
    tis_clip: float | None = None  # truncated importance sampling (Yao et al. 2025; algos/losses.tis_weights): each
    # token's policy loss times min(pi_trainer / pi_sampler, tis_clip), for a sampler that is not the trainer
    # (rollout.backend: vllm; 2.0 is the paper's C). None: off
    approx_kl_warning: float | None = 0.5  # warn when one step's approx-KL exceeds this (None: never)
    share_prompt_prefix: bool = False  # the tokens every episode of a batch begins with (system message, tool
    # schemas) run once per forward, not once per episode (trainers/common.common_prefix_logprobs): the same
    # maths up to float rounding; decisive for chat-template prompts on a real model
    gae_level: Literal["token", "turn"] = "token"  # "turn": GAE over an episode's turns (values read where each
    # turn starts: the state the environment returned), each turn's advantage and return given to all its tokens,
    # its rewards (score and KL terms) summed (algos.turn_gae); "token": TRL's GAE over every sampled token

    def __post_init__(self):
        check_log_with(self.log_with)
        # Checked here, not only in the job's config: PPOConfig(cliprange=float("nan")) built in code must fail too.
        # A comparison with NaN is False, so NaN fails every one of these.
        for name, low, high in (("learning_rate", 0, math.inf), ("cliprange", 0, math.inf),
                                ("cliprange_value", 0, math.inf), ("temperature", 0, math.inf)):
            if not low < getattr(self, name) < high:
                raise UserError(f"{name}: must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("init_kl_coef", "vf_coef", "ptx_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise UserError(f"{name}: must be a finite number >= 0, got {getattr(self, name)!r}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"{name}: must be in [0, 1], got {getattr(self, name)!r}")
        if self.tis_clip is not None and self.tis_clip <= 0:
            raise ValueError(f"tis_clip must be > 0 (or None: off), got {self.tis_clip}")
        if self.gae_level not in ("token", "turn"):
            raise ValueError(f"gae_level must be 'token' or 'turn', got {self.gae_level!r}")
        if self.kl_penalty not in ("kl", "abs", "mse", "full"):
            raise ValueError(f"kl_penalty must be one of kl, abs, mse, full; got {self.kl_penalty!r}")
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.ptx_coef > 0 and not self.ptx_data:
            raise ValueError("ptx_coef > 0 needs ptx_data: a demonstrations JSONL file, or 'env' in an agentrl job")
        backward = self.mini_batch_size * self.gradient_accumulation_steps
        if backward > self.batch_size and self.batch_size % self.mini_batch_size == 0:
            # Tutorials ask for batch_size=1, mini_batch_size=1, gradient_accumulation_steps=4, which TRL
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

    def to_dict(self) -> dict[str, Any]:
        """The fields as a flat dict (nested dicts joined with "/"), as TRL 0.11 records them with trackers."""
        return core.flatten_dict(dict(self.__dict__))


def policy_metrics(stats: dict) -> dict:
    """The update's numbers in the vocabulary every agent trainer logs (GRPO writes the same keys), from TRL 0.11's
    step statistics, which `step()` keeps returning as they are. objective/kl is a sum over each episode's policy
    tokens averaged over episodes; over the mean response length it is the KL per policy token."""
    return {"policy/kl": stats["objective/kl"] / max(stats["tokens/responses_len_mean"], 1.0),
            "policy/entropy": stats["ppo/policy/entropy"], "policy/clipfrac": stats["ppo/policy/clipfrac"]}


def warn_if_approx_kl_explodes(approx_kl: float, config: PPOConfig, step: int) -> None:
    """A warning when one update moved the policy far outside PPO's trust region: a healthy LLM PPO step has
    an approx-KL of 0.001-0.05 (Huang et al. 2024). Nothing else in the log shows a collapse until the policy's
    accuracy is gone (docs/real-model.md)."""
    approx_kl = float(np.max(np.asarray(approx_kl, dtype=float)))  # several processes: one value per process
    if config.approx_kl_warning is not None and not approx_kl <= config.approx_kl_warning:
        warnings.warn(f"PPO step {step}: approx-KL {approx_kl:.3g} between the rollout policy and the updated one "
                      f"exceeds ppo.approx_kl_warning={config.approx_kl_warning:g}: the update left PPO's trust "
                      f"region and the policy may collapse; lower ppo.learning_rate (and ppo.norm_learning_rate), or "
                      f"set ppo.early_stopping=true with ppo.target_kl", stacklevel=2)


# Mean |logprob| gap between the sampler and the trainer's first forward above which the sampler's logprobs
# and values are not reused (PPOConfig.reuse_rollout_logprobs): fp32 noise is ~1e-6; bf16 autocast, a changed
# temperature or padding, or non-deterministic layers exceed it, and the old forward runs instead.
REUSE_TOLERANCE = 1e-3


class _StaleRollout(Exception):
    """The sampler's logprobs differ from the trainer's forward at the same weights (see REUSE_TOLERANCE)."""


class PPOTrainer:
    """PPO with a value head on the policy's own backbone.

    model: a causal LM, a `PeftModel` (as the tutorials make with `get_peft_model`), or an
    `AutoModelForCausalLMWithValueHead`. Under LoRA the reference is the adapter-disabled backbone and no
    second model exists; for full fine-tuning, `ref_model` or else a frozen copy is the reference.
    """

    def __init__(self, config: PPOConfig | None = None, model=None, ref_model=None, tokenizer=None,
                 optimizer: torch.optim.Optimizer | None = None, num_shared_layers: int | None = None,
                 lr_scheduler=None):
        self.config = config = config or PPOConfig()
        self.logprob_paths = FAST  # the exact logprob shortcuts (trainers/common.LogprobPaths)
        if model is None or tokenizer is None:
            raise ValueError("PPOTrainer needs `model` and `tokenizer`")
        project = {"project_dir": config.project_dir, **config.project_kwargs}
        self.accelerator = make_accelerator(gradient_accumulation_steps=config.gradient_accumulation_steps,
                                            mixed_precision=config.mixed_precision, log_with=config.log_with,
                                            project_config=ProjectConfiguration(**project), **config.accelerator_kwargs)
        # Each rank its own stream (seed + rank): rank 0 draws exactly what a single process draws.
        set_seed(config.seed + self.accelerator.process_index)
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError("encoder-decoder models are not supported; use a causal LM")
        if not isinstance(model, AutoModelForCausalLMWithValueHead):
            model = AutoModelForCausalLMWithValueHead(model, v_head_init_std=config.value_head_init_std)
        self.is_peft_model = config.is_peft_model = model.is_peft_model
        self.is_encoder_decoder = config.is_encoder_decoder = False
        if ref_model is not None:
            if num_shared_layers is not None:
                warnings.warn("num_shared_layers is ignored when ref_model is provided. Two different models are "
                              "used for the model and the reference model and no layers are shared.", UserWarning,
                              stacklevel=2)
            self.ref_model = ref_model.eval().requires_grad_(False)
        elif self.is_peft_model:
            self.ref_model = None  # the adapter-disabled backbone
        else:
            # A frozen copy; with num_shared_layers the first layers are shared and frozen in the policy too.
            self.ref_model = create_reference_model(model, num_shared_layers=num_shared_layers)
        if config.gradient_checkpointing:
            checkpoint_activations(model.pretrained_model, self.is_peft_model)
        self.tokenizer = tokenizer
        default_pad_token(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; the policy could never end an episode")

        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        # The value head and the norm gains may get their own learning rates (see optimizer_groups). A separate
        # critic rate is the norm in RLHF PPO (OpenRLHF's critic_learning_rate, verl's critic.optim.lr).
        head = [p for p in model.v_head.parameters() if p.requires_grad]
        groups = optimizer_groups(params, config.learning_rate, [(head, config.value_learning_rate),
                                                                 (norm_gain_parameters(model), config.norm_learning_rate)])
        self.optimizer = optimizer or torch.optim.Adam(groups, lr=config.learning_rate, eps=config.adam_eps)
        if lr_scheduler is not None and not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError("lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler")
        if lr_scheduler is not None and config.anneal_lr:
            raise ValueError("PPOConfig.anneal_lr sets the learning rates itself; pass no lr_scheduler with it")
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        # Prepared, the scheduler steps with the optimizer's real steps (gradient accumulation included).
        self.lr_scheduler = self.accelerator.prepare(lr_scheduler) if lr_scheduler is not None else None
        self._peak_lrs = [group["lr"] for group in self.optimizer.param_groups]  # what anneal_lr falls from
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)
        self.current_device = self.accelerator.device
        self.is_distributed = self.accelerator.num_processes > 1
        self.kl_ctl = (AdaptiveKLController(config.init_kl_coef, config.target, config.horizon) if config.adap_kl_ctrl
                       else FixedKLController(config.init_kl_coef))
        self.current_step = 0
        self.ptx = None  # PPO-ptx demonstrations (set_ptx_data)
        self.rollout_backend = None  # None: sample with the policy (hf); a job sets a VLLMRollout for rollout.backend: vllm
        if config.ptx_coef > 0 and config.ptx_data != "env":
            self.set_ptx_data(config.ptx_data)
        self.metrics_log = MetricsLog(None, self.accelerator)
        self.samples_log = SamplesLog(None)  # a job sets SamplesLog(run_dir/"samples.jsonl", ...) to sample episodes
        self._sample_tensors: dict = {}  # the last update's per-token tensors, for samples_log
        if config.log_with:
            self.accelerator.init_trackers(config.tracker_project_name, config=_flat_config(config),
                                           init_kwargs=config.tracker_kwargs)
        # Dropout off everywhere, during rollouts and updates alike (Huang et al. 2024).
        eval_mode(self.model)

    def set_ptx_data(self, demonstrations, name: str | None = None) -> None:
        """PPO-ptx: each update adds ptx_coef * the SFT loss on a batch (mini_batch_size) of these demonstrations
        (a JSONL path or a list of rows, see trainers/sft.py)."""
        from agentrl.trainers.sft import DemonstrationBatches, encode_demonstrations, read_demonstrations

        examples, _, _ = encode_demonstrations(read_demonstrations(demonstrations, name), self.tokenizer)
        self.ptx = DemonstrationBatches(examples, self.config.mini_batch_size, self.tokenizer.pad_token_id,
                                        self.config.seed)

    @property
    def policy(self):
        """The causal LM being trained (a PeftModel under LoRA), unwrapped from accelerate."""
        return self.accelerator.unwrap_model(self.model).pretrained_model

    @property
    def _reuses_rollout(self) -> bool:
        """reuse_rollout_logprobs in effect: not under fp16/bf16 mixed precision, where the sampler's logprobs
        differ from the update's forward by more than REUSE_TOLERANCE anyway (measured: 0.002 mean at bf16, with
        the sampler under the same autocast), so checking them would only cost a wasted forward."""
        return self.config.reuse_rollout_logprobs and self.accelerator.mixed_precision == "no"

    @property
    def _rollout_value_head(self):
        """The value head for the sampler to read (reuse_rollout_logprobs), else None."""
        return self.accelerator.unwrap_model(self.model).v_head if self._reuses_rollout else None

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
        bar = progress_bar(steps, "PPO", progress and self.accelerator.is_main_process)
        total_steps = self.current_step + steps  # a resumed run anneals over the whole run, not what is left
        for i in range(steps):
            if self.config.anneal_lr:
                self._anneal_lr(total_steps)
            # Every rank draws the same global batch from the same cycler and keeps its own slice: distinct
            # tasks per rank, one task order to checkpoint (batch_size is per process, as in TRL 0.11).
            global_tasks = cycler.draw(self.config.batch_size * self.accelerator.num_processes)
            sync_seconds, sampler = None, None
            if self.rollout_backend is not None:  # vLLM samples with this step's weights (no values: a forward)
                sync_seconds, sampler = self.rollout_backend.sync_weights(self.policy), self.rollout_backend.sample
            with self.accelerator.split_between_processes(global_tasks) as batch_tasks:
                started = time.time()
                with gathered_for_generation(self.accelerator, self.model), self.accelerator.autocast():
                    episodes = rollout(self.policy, self.tokenizer, env_factory, batch_tasks, sampling,
                                       value_head=self._rollout_value_head, sampler=sampler)
            if score_hook is not None:  # e.g. reward models adding to the environment's scores
                score_hook(episodes)
            rollout_seconds = time.time() - started
            batch = episodes_to_batch(episodes, self.tokenizer.pad_token_id, self.config.missing_eos_penalty)
            check_batch(episodes, batch)
            mask_infra_failures(episodes, batch)  # failures outside the policy teach it nothing
            stats = self._update(batch, turn_end_mask(episodes, batch) if self.config.gae_level == "turn" else None)
            stats.update(policy_metrics(stats))
            warn_if_approx_kl_explodes(stats["ppo/policy/approxkl"], self.config, self.current_step)
            end_of_step(self, stats, episodes, episodes, rollout_seconds, sync_seconds, history, callback, checkpointer,
                        bar, i == steps - 1, lambda st: {"score": f"{st['ppo/mean_scores']:.2f}",
                                                         "acc": f"{st['env/accuracy']:.2f}",
                                                         "kl": f"{st['objective/kl']:.3f}"})
        if bar is not None:
            bar.close()
        return history

    def _anneal_lr(self, total_steps: int) -> None:
        """Linear decay by PPO step (CleanRL's anneal_lr): the full rates at the first step, 1/total_steps of
        them at the last. Set from the step count, so a resumed run continues the same schedule. Not a LambdaLR
        through `lr_scheduler`: the run's length is known only in train(), and accelerate's prepared scheduler
        steps once per process on each call, which would anneal faster under DDP."""
        frac = 1.0 - self.current_step / total_steps
        for group, peak in zip(self.optimizer.param_groups, self._peak_lrs):
            group["lr"] = peak * frac

    # --- the update ------------------------------------------------------------------------------------

    def _fast_lm(self):
        """(the causal LM, the value head) when logprobs may come from `response_logprobs` (one process: the
        model is not wrapped for distributed training; self.logprob_paths allows it), else None."""
        if self.model is not self.accelerator.unwrap_model(self.model) or not self.logprob_paths.response_only:
            return None
        return self.model.pretrained_model, self.model.v_head

    def _policy_forward(self, batch: TokenBatch, entropy_grad: bool = False):
        """(logprobs, values, entropy (B, T-1), logits (B, T, V) or None): only at response positions when the
        model allows (response_logprobs), else the full forward."""
        fast = self._fast_lm()
        if fast is not None and self.config.share_prompt_prefix:
            out = common_prefix_logprobs(fast[0], batch, self.config.temperature, with_entropy=True,
                                         entropy_grad=entropy_grad, value_head=fast[1],
                                         rest_min_saving=self.logprob_paths.rest_min_saving,
                                         rest_buckets=self.logprob_paths.rest_buckets)
            if out is not None:
                return out[0], out[2], out[1], None
        if fast is not None:
            # Rows of similar length forward together (by_length): episodes of an agent loop vary a lot.
            out = by_length(lambda b: response_logprobs(fast[0], b, self.config.temperature, with_entropy=True,
                                                        value_head=fast[1], entropy_grad=entropy_grad) or (None,) * 3,
                            batch, min_saving=self.logprob_paths.bucket_min_saving)
            if out[0] is not None:
                return out[0], out[2], out[1], None
        logprobs, values, _, logits = policy_forward(self.model, batch, self.config.temperature)
        return logprobs, values, None, logits

    @torch.no_grad()
    def _ref_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """The reference's logprobs (B, T-1) at response positions (others may be 0)."""
        ref_lm = self._ref_lm or self.policy
        with self._reference():
            out = None
            if self._fast_lm() and self.config.share_prompt_prefix:
                out = common_prefix_logprobs(ref_lm, batch, self.config.temperature,
                                             rest_min_saving=self.logprob_paths.rest_min_saving,
                                         rest_buckets=self.logprob_paths.rest_buckets)
            if out is None and self._fast_lm():
                out = response_logprobs(ref_lm, batch, self.config.temperature)
            return out[0] if out is not None else lm_logprobs(ref_lm, batch, self.config.temperature)

    @torch.no_grad()
    def _old_and_ref(self, batch: TokenBatch, reuse: bool = False,
                     ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        # The reference runs on the unwrapped model: under FSDP / ZeRO-3 with the parameters gathered.
        with gathered_for_generation(self.accelerator, self.model):
            return self._old_and_ref_gathered(batch, reuse, ref_logprobs)

    def _old_and_ref_gathered(self, batch: TokenBatch, reuse: bool = False,
                              ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """No-grad forwards in mini-batch chunks: (old_logprobs, values, ref_logprobs, kl), each (B, T-1).

        reuse: old logprobs and values are the sampler's (batch.logprobs, batch.values); only the reference runs.
        ref_logprobs: the reference's, already computed for this batch (a retry after _StaleRollout).
        """
        T, kind = self.config.temperature, self.config.kl_penalty
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for start in range(0, len(batch), self.config.mini_batch_size):
            chunk = batch.select(torch.arange(start, min(start + self.config.mini_batch_size, len(batch))))
            pad = batch.loss_mask.shape[1] - chunk.loss_mask.shape[1]
            with self.accelerator.autocast():
                if kind == "full":  # the exact KL needs both full distributions
                    logp, v, _, logits = policy_forward(self.model, chunk, T)
                    with self._reference():
                        ref_logp, ref_logits = lm_logprobs(self._ref_lm or self.policy, chunk, T, return_logits=True)
                    kl = kl_penalty(logp, ref_logp, kind, logits[:, :-1] / T, ref_logits[:, :-1] / T)
                else:
                    logp, v = (chunk.logprobs, chunk.values) if reuse else self._policy_forward(chunk)[:2]
                    ref_logp = (self._ref_logprobs(chunk) if ref_logprobs is None else
                                ref_logprobs[start:start + len(chunk), :chunk.loss_mask.shape[1]])
                    kl = kl_penalty(logp, ref_logp, kind)
            for out, x in zip(parts, (logp, v, ref_logp, kl)):
                out.append(torch.nn.functional.pad(x, (0, pad)))
        return tuple(torch.cat(p) for p in parts)

    def _reuse_rollout(self, batch: TokenBatch) -> bool:
        """Whether this batch's old logprobs and values may be the sampler's (see PPOConfig.reuse_rollout_logprobs)."""
        return (self._reuses_rollout and batch.logprobs is not None and batch.values is not None
                and self.config.kl_penalty != "full")

    def _reference(self):
        if self.ref_model is None:
            return self.accelerator.unwrap_model(self.model).adapter_disabled()
        return contextlib.nullcontext()

    @property
    def _ref_lm(self):
        """The reference as a plain causal LM (None under LoRA: the adapter-disabled policy is the reference)."""
        ref = self.ref_model
        return ref.pretrained_model if isinstance(ref, AutoModelForCausalLMWithValueHead) else ref

    def _update(self, batch: TokenBatch, turn_ends: torch.Tensor | None = None) -> dict[str, float]:
        """One PPO step on a batch. turn_ends (B, T-1): 1 at each turn's last sampled token, for gae_level "turn"
        (None: each run of sampled tokens is a turn)."""
        cfg, t0 = self.config, time.time()
        if cfg.ptx_coef > 0 and self.ptx is None:
            raise ValueError("ptx_data='env' needs trainer.set_ptx_data(demonstrations) (agentrl jobs call it)")
        eval_mode(self.model)  # dropout off, whatever the caller did to the model in between
        batch = batch.to(self.accelerator.device)
        mask = batch.loss_mask  # (B, T-1): 1 on sampled tokens only; prompt, tool output, padding are 0
        reuse = self._reuse_rollout(batch)
        # Two tries: with the sampler's logprobs and values, then, if the first mini-batch's forward at the
        # rollout's weights disagrees with them (_StaleRollout, before any optimizer step), with a forward.
        rng = torch.get_rng_state()  # a retry shuffles the mini-batches as the first try did
        ref_logprobs = None
        for reuse in ((True, False) if reuse else (False,)):
            torch.set_rng_state(rng)
            old_logprobs, values, ref_logprobs, kl = self._old_and_ref(batch, reuse, ref_logprobs)  # a retry keeps
            # the reference's logprobs of the first try (kl_penalty "full", which needs its logits, never retries)
            mismatch = {}
            if batch.logprobs is not None and not reuse:
                mismatch = logprob_mismatch(old_logprobs, batch.logprobs, mask, cfg.logprob_mismatch_threshold)
                mismatch = global_logprob_mismatch(self.accelerator, mismatch)
            tis = None  # (B, T-1) truncated importance weights, with tis_clip and the sampler's logprobs
            if cfg.tis_clip is not None and batch.logprobs is not None:
                tis, tis_stats = tis_weights(old_logprobs, batch.logprobs, mask, cfg.tis_clip)
            t_forward = time.time()

            # Per-token rewards: -beta * KL at every action token, plus each turn's score at its last token.
            kl = kl * mask
            rewards, non_score_rewards = kl_shaped_rewards(batch.scores, kl, self.kl_ctl.value)
            t_rewards = time.time()
            raw_values = values
            values, advantages, returns = self.compute_advantages(values, rewards, mask, turn_ends)
            self._sample_tensors = {"trainer_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
                                    "advantages": advantages, "values": raw_values}
            t_adv = time.time()
            try:
                all_stats, skipped, nonfinite, checked = self._optimize(batch, old_logprobs, values, advantages,
                                                                        returns, check_rollout=reuse, tis=tis)
                mismatch = checked or mismatch
                if tis is not None:
                    mismatch.update({f"tis/{k}": v.item() for k, v in tis_stats.items()})
                break
            except _StaleRollout:
                continue
        t_opt = time.time()

        train_stats = core.stack_dicts(all_stats)
        # Advantages and ratios of every mini-batch, flattened, rather than averaged (TRL 0.11).
        train_stats["policy/advantages"] = torch.nan_to_num(
            torch.flatten(train_stats["policy/advantages"]).unsqueeze(0), core.WANDB_PADDING)
        query_lens = (mask.float().argmax(-1) + 1).where(mask.any(-1), batch.attention_mask.sum(-1)).float()
        scores, response_lens = batch.scores.sum(-1), mask.sum(-1).float()
        if self.is_distributed:  # per-episode numbers of every rank (each has batch_size), for global score stats
            scores, query_lens, response_lens = (self.accelerator.gather(x) for x in (scores, query_lens, response_lens))
        stats = self.record_step_stats(
            kl_coef=self.kl_ctl.value, scores=scores, logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            non_score_reward=non_score_rewards, train_stats=train_stats, masks=mask, kls=kl,
            query_lens=query_lens, response_lens=response_lens)
        if self.is_distributed:
            stats = self.gather_stats(stats)
        stats = core.convert_to_scalar(core.stats_to_np(stats))
        stats.update({
            "ppo/learning_rate": self.optimizer.param_groups[0]["lr"],
            "ppo/skipped_minibatches": float(skipped),
            "train/skipped_nonfinite": float(nonfinite),
            "time/ppo/forward_pass": t_forward - t0,
            "time/ppo/compute_rewards": t_rewards - t_forward,
            "time/ppo/compute_advantages": t_adv - t_rewards,
            "time/ppo/optimize_step": t_opt - t_adv,
            "time/ppo/calc_stats": time.time() - t_opt,
            **mismatch,
        })
        self.kl_ctl.update(stats["objective/kl"], cfg.batch_size * cfg.world_size)
        stats["time/ppo/total"] = time.time() - t0
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        return stats

    def _optimize(self, batch: TokenBatch, old_logprobs, values, advantages, returns, check_rollout: bool,
                  tis: torch.Tensor | None = None):
        """The clipped epochs over shuffled mini-batches. Returns (stats per mini-batch, skipped, non-finite
        events, mismatch stats or {}).

        check_rollout: old_logprobs are the sampler's; the first mini-batch's forward, at the rollout's weights
        (no optimizer step yet), is compared with them first. A mean gap above REUSE_TOLERANCE raises
        _StaleRollout (the caller recomputes them with a forward); above logprob_mismatch_threshold, the error
        of logprob_mismatch. tis: (B, T-1) truncated importance weights on the policy loss (PPOConfig.tis_clip).
        """
        cfg = self.config
        all_stats, skipped, nonfinite, mismatch = [], 0, 0, {}
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
                        logprobs, vpred, entropy, logits = self._policy_forward(mb, entropy_grad=cfg.entropy_coef != 0)
                    if check_rollout and not all_stats:
                        mismatch = global_logprob_mismatch(self.accelerator, logprob_mismatch(
                            logprobs.detach(), mb.logprobs, mb.loss_mask, None))  # one decision on every rank
                        if not mismatch["rollout/logprob_mismatch_mean"] <= REUSE_TOLERANCE:
                            self.optimizer.zero_grad()
                            raise _StaleRollout
                    pg_loss, vf_term, mb_stats = self.loss(mb_old, mb_values, None if logits is None else
                                                           logits[:, :-1] / cfg.temperature, vpred, logprobs,
                                                           mb.loss_mask, mb_adv, mb_ret, entropy=entropy,
                                                           tis_weights=None if tis is None else tis[idx, :w])
                    loss = pg_loss + vf_term - cfg.entropy_coef * mb_stats["policy/entropy"]
                    scale = global_token_scale(self.accelerator, mb.loss_mask)
                    if scale is not None:  # several processes: token means over the global mini-batch
                        loss = loss * scale
                    if self.ptx is not None:  # PPO-ptx: keep what SFT taught (the LM loss on demonstrations)
                        with self.accelerator.autocast():
                            ptx_loss = sft_loss(self.policy, self.ptx.next())
                        loss = loss + cfg.ptx_coef * ptx_loss
                        mb_stats["loss/ptx"] = ptx_loss.detach()  # logged as ppo/loss/ptx
                    if mb_stats["policy/skipped"]:
                        loss, skipped = loss * 0.0, skipped + 1  # TRL 0.11: the mini-batch is skipped
                    nonfinite += guarded_step(self.accelerator, self.model, self.optimizer, loss, cfg.max_grad_norm)
                    # No arguments: the caller's optimizer decides (set_to_none or not); accelerate handles
                    # accumulation (https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation).
                    self.optimizer.zero_grad()
                mb_stats["loss/total"] = loss.detach()
                del mb_stats["policy/skipped"]
                all_stats.append(mb_stats)
                epoch_kl.append(mb_stats["policy/policykl"].item())
            if cfg.early_stopping:  # the same decision on every rank, from the global mean KL
                mean_kl = sum(epoch_kl) / len(epoch_kl)
                if self.is_distributed:
                    mean_kl = self.accelerator.reduce(torch.tensor(mean_kl, device=self.accelerator.device),
                                                      "mean").item()
                if mean_kl > 1.5 * cfg.target_kl:
                    break
        return all_stats, skipped, nonfinite, mismatch

    # --- the pieces of the update (public names as in TRL 0.11, whose step() the adapter runs through them) ---

    def compute_advantages(self, values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
                           turn_ends: torch.Tensor | None = None):
        """GAE over the mask-1 positions (B, T) -> (values, advantages, returns), each (B, T), 0 where mask is 0.

        gae_level "turn": GAE over turns instead (algos.turn_gae; turn_ends (B, T) marks each turn's last token,
        None: the last of each run of mask-1 positions).

        Rewards are whitened first with `whiten_rewards`; advantages are whitened over the mask (TRL always
        does; `whiten_advantages=False` turns it off) and detached. Mask-0 positions inside a row (tool output)
        are skipped, not treated as steps with value 0: see `agentrl.algos.gae`.
        """
        values, rewards = values * mask, rewards * mask
        # Several processes: mean and variance over the global batch (every rank's tokens), not per rank.
        moments = (lambda x: global_masked_moments(self.accelerator, x, mask)) if self.accelerator.num_processes > 1 \
            else (lambda x: None)
        if self.config.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False, moments=moments(rewards))
        if self.config.gae_level == "turn":
            advantages, returns = turn_gae(rewards, values, mask, None if turn_ends is None else turn_ends.to(mask.device),
                                           self.config.gamma, self.config.lam)
        else:
            advantages, returns = gae(rewards, values, mask, self.config.gamma, self.config.lam)
        if self.config.whiten_advantages:
            advantages = whiten(advantages, mask, moments=moments(advantages))

        return values, advantages.detach(), returns.detach()

    def loss(self, old_logprobs: torch.Tensor, values: torch.Tensor, logits: torch.Tensor | None,
             vpreds: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
             returns: torch.Tensor, entropy: torch.Tensor | None = None, tis_weights: torch.Tensor | None = None):
        """PPO's clipped policy and value losses on one mini-batch; all (B, T) but logits (B, T, V) (or None with
        `entropy` (B, T) given, as the trainer's response-only forward computes it). tis_weights (B, T): truncated
        importance weights on the policy loss (PPOConfig.tis_clip), or None.

        Returns (pg_loss, vf_coef * vf_loss, stats): TRL 0.11's flat stats dict of detached tensors. A
        mini-batch whose mean ratio exceeds `ratio_threshold` is skipped: both losses become 0.
        """
        cfg = self.config
        pg_loss, pg_stats = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cfg.cliprange, tis_weights)
        vf_loss, vf_stats = ppo_value_loss(vpreds, values, returns, mask, cfg.cliprange_value)
        ratio = pg_stats["ratio"]
        if self.accelerator.num_processes > 1:  # one decision on every rank, from the global mean ratio
            n = mask.sum()
            ratio = sum_over_processes(self.accelerator, ratio * n) / sum_over_processes(self.accelerator, n).clamp(min=1)
        skip = ratio.item() > cfg.ratio_threshold
        if skip:
            warnings.warn(f"The average ratio of batch ({ratio.item():.2f}) exceeds threshold "
                          f"{cfg.ratio_threshold:.2f}. Skipping batch.", stacklevel=2)
            pg_loss, vf_loss = pg_loss * 0.0, vf_loss * 0.0
        entropy = masked_mean(entropy_from_logits(logits) if entropy is None else entropy, mask)
        with torch.no_grad():
            stats = {
                "loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
                "loss/total": (pg_loss + cfg.vf_coef * vf_loss).detach(),
                "policy/entropy": entropy, "policy/approxkl": pg_stats["approxkl"],
                "policy/policykl": pg_stats["policykl"], "policy/clipfrac": pg_stats["clipfrac"],
                "policy/k3kl": pg_stats["k3kl"], "policy/advantages": advantages.detach(),
                "policy/advantages_mean": masked_mean(advantages, mask).detach(), "policy/ratio": pg_stats["ratio"],
                "returns/mean": masked_mean(returns, mask), "returns/var": masked_var(returns, mask),
                "val/vpred": masked_mean(vpreds, mask).detach(),
                "val/error": masked_mean((vpreds - returns) ** 2, mask).detach(),
                "val/clipfrac": vf_stats["clipfrac"], "val/mean": masked_mean(values, mask),
                "val/var": masked_var(values, mask), "policy/skipped": skip,
            }
        return pg_loss, cfg.vf_coef * vf_loss, stats

    def record_step_stats(self, kl_coef: float, **data) -> dict:
        """TRL 0.11's step statistics from the pieces of a step.

        data: masks, kls, logprobs, ref_logprobs, non_score_reward (B, T); scores (B,); train_stats (stacked
        per-mini-batch stats of `loss`); and queries/responses (lists of tensors) or query_lens/response_lens.
        """
        mask, kls = data.pop("masks"), data.pop("kls")
        kl_list = (kls * mask).sum(dim=-1)
        mean_kl = kl_list.mean()
        if mean_kl.item() < -1.0:
            warnings.warn(f"KL divergence is starting to become negative: {mean_kl.item():.2f} - this might be a "
                          "precursor for failed training. sometimes this happens because the generation kwargs are "
                          "not correctly set. Please make sure that the generation kwargs are set correctly, or "
                          "review your training hyperparameters.", stacklevel=2)
        scores = data["scores"]
        stats = {
            "objective/kl": mean_kl,
            "objective/kl_dist": kl_list,
            "objective/logprobs": data["logprobs"],
            "objective/ref_logprobs": data["ref_logprobs"],
            "objective/kl_coef": kl_coef,
            "objective/entropy": (-data["logprobs"] * mask).sum(dim=-1).mean(),
            "ppo/mean_non_score_reward": core.masked_mean(data["non_score_reward"], mask),
            "ppo/mean_scores": scores.mean(),
            "ppo/std_scores": scores.std(unbiased=False),  # 0, not NaN, at batch_size=1
        }
        query_lens = data.get("query_lens")
        if query_lens is None:
            query_lens = torch.tensor([len(q) for q in data["queries"]], dtype=torch.float)
        response_lens = data.get("response_lens")
        if response_lens is None:
            response_lens = torch.tensor([len(r) for r in data["responses"]], dtype=torch.float)
        query_lens, response_lens = query_lens.float().cpu(), response_lens.float().cpu()
        stats.update({
            "tokens/queries_len_mean": query_lens.mean().item(), "tokens/queries_len_std": query_lens.std(unbiased=False).item(),
            "tokens/queries_dist": query_lens.numpy(),
            "tokens/responses_len_mean": response_lens.mean().item(),
            "tokens/responses_len_std": response_lens.std(unbiased=False).item(), "tokens/responses_dist": response_lens.numpy(),
        })
        for key, value in data["train_stats"].items():
            stats[f"ppo/{key}"] = torch.mean(value, dim=0)
        stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        return stats

    def gather_stats(self, stats: dict) -> dict:
        """Stats of every process (distributed training): scalar tensors averaged over processes (TRL 0.11), array
        tensors (per-episode or per-token) gathered, padded with zeros to one width; others kept as they are.

        objective/kl, the KL controller's input, is a mean over episodes; every rank has batch_size of them, so
        the mean over processes is the global mean.
        """
        if self.accelerator.num_processes == 1:
            return stats
        out = {}
        for k, v in stats.items():  # the same keys in the same order on every rank: the collectives line up
            if isinstance(v, torch.Tensor):
                v = v.to(self.accelerator.device)
                if v.dim() == 0:
                    v = self.accelerator.reduce(v.float().clone(), "mean")
                else:
                    v = self.accelerator.gather(self.accelerator.pad_across_processes(v.contiguous(), dim=v.dim() - 1))
            out[k] = v
        return out

    # --- checkpoints (agentrl.checkpoint) ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (weights, optimizer, KL controller, RNGs, ...)."""
        return trainer_state(self, kl_ctl=vars(self.kl_ctl),
                             lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler else None)

    def load_state_dict(self, state: dict) -> None:
        load_trainer_state(self, state)
        vars(self.kl_ctl).update(state["kl_ctl"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def save_checkpoint(self, directory: str) -> None:
        save_trainer_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(self, directory)

    def save_pretrained(self, save_directory: str) -> None:
        """Write the policy (adapter under LoRA) and the value head, atomically, refusing non-finite weights."""
        save_weights(self.accelerator, self.model, save_directory, self._write_policy)

    def _write_policy(self, tmp: str, full: dict | None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        tokenizer = None if self.is_peft_model else self.tokenizer  # a full model directory needs its tokenizer
        if full is None:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            return
        # The gathered tensors, split into the LM's (adapter under LoRA) and the value head's (the value-head
        # model's state_dict spells the LM's keys with or without "pretrained_model.").
        from safetensors.torch import save_file

        from agentrl.models.value_head import VALUE_HEAD_FILE

        lm = {k.removeprefix("pretrained_model."): v for k, v in full.items() if not k.startswith("v_head.")}
        head = {k: v.contiguous() for k, v in full.items() if k.startswith("v_head.")}
        write_lm(model.pretrained_model, tmp, lm if self.is_peft_model else {**lm, **head}, tokenizer)
        save_file(head, str(Path(tmp) / VALUE_HEAD_FILE))


def turn_end_mask(episodes: list[Episode], batch: TokenBatch) -> torch.Tensor:
    """(B, T-1): 1 at the position predicting each turn's last sampled token (where its score sits), from
    Episode.turn_ends: exact even where two turns meet with no observation tokens between them."""
    ends = torch.zeros_like(batch.loss_mask)
    for i, ep in enumerate(episodes):
        n = len(ep.prompt_ids)
        ends[i, [n + e - 1 for e in ep.turn_ends]] = 1.0
    return ends


def _flat_config(config: PPOConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(config).items() if isinstance(v, (int, float, str, bool)) or v is None}
