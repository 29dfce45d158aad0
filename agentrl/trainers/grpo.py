"""GRPO / Dr. GRPO / RLOO for tool-using agents: critic-free, on the same rollout engine as PPO.

Top to bottom: config, set-up, `train()` (groups of `num_generations` episodes per task), `_update`
(advantages from episode scores -> clipped ratio epochs -> stats). Per-turn rewards an environment
returns are *summed* into the episode score, and that one advantage goes to every sampled token
(PPO instead puts each turn's reward on the last token of its turn).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

import torch
from accelerate.utils import set_seed

from agentrl.algos import (anchor_state_advantages, group_advantages, grpo_loss, masked_mean, rloo_advantages,
                           turn_returns, zero_variance_fraction)
from agentrl.algos.losses import tis_weights
from agentrl.rollout.engine import Episode, rollout
from agentrl.rollout.sampling import SamplingParams
from agentrl.samples import SamplesLog
from agentrl.trainers.common import (FAST, MetricsLog, TokenBatch, check_batch, check_log_with, default_pad_token,
                                     end_of_step, episodes_to_batch, eval_mode, gathered_for_generation,
                                     global_logprob_mismatch, global_token_scale, guarded_step, load_trainer_checkpoint,
                                     load_trainer_state, logprob_mismatch, make_accelerator, mask_infra_failures,
                                     masked_logprobs, mean_over_processes, norm_gain_parameters, optimizer_groups,
                                     progress_bar, resumed_cycler, resumed_metrics, save_trainer_checkpoint,
                                     save_weights, trainer_state, write_lm)


@dataclass
class GRPOConfig:
    seed: int = 0  # random seed
    steps: int = 100  # training steps (each of tasks_per_step * num_generations episodes)
    learning_rate: float = 1e-6  # Adam learning rate (TRL's GRPO default; LoRA on tiny models wants far more)
    tasks_per_step: int = 8  # distinct tasks per step
    num_generations: int = 8  # episodes per task: the group whose scores are compared
    num_iterations: int = 1  # optimisation passes over each batch (mu in the GRPO paper)
    mini_batch_size: int = 64  # episodes per optimisation step
    gradient_accumulation_steps: int = 1  # mini-batches per optimizer step
    epsilon: float = 0.2  # ratio clip, lower side
    epsilon_high: float | None = None  # ratio clip, upper side (None: = epsilon; DAPO uses 0.28)
    beta: float = 0.0  # KL to the reference (k3); 0 means no reference forward at all
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"  # grpo: (s - mean) / std; dr_grpo: s - mean; rloo
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"  # how token losses are averaged
    temperature: float = 1.0  # sampling temperature; logprobs are computed at it
    max_grad_norm: float | None = 1.0  # gradient-norm clip (None: off)
    adam_eps: float = 1e-8  # Adam epsilon
    norm_learning_rate: float | None = None  # learning rate of trainable norm gains (None: learning_rate)
    missing_eos_penalty: float | None = None  # subtracted from the score of episodes cut by max_new_tokens
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = "no"  # accelerate's; auto: bf16 where native
    log_with: str | None = None  # accelerate tracker ("tensorboard", "wandb", ...)
    tracker_project_name: str = "agentrl"  # project name for the trackers
    project_dir: str | None = None  # where trackers write
    tracker_kwargs: dict = field(default_factory=dict)  # passed to init_trackers(init_kwargs=...)
    logprob_mismatch_threshold: float | None = 0.05  # error when the mean |recomputed - sampled| logprob at
    # the rollout's weights exceeds this (None: only logged as rollout/logprob_mismatch_*)
    step_advantage_weight: float = 0.0  # GiGPO (Feng et al. 2025, arXiv:2505.10978): each token's advantage is its
    # episode's plus this times its turn's step advantage (the turn's return against those of the other turns
    # taken from the same state in its group; algos/group.anchor_state_advantages). 0: off; the paper uses 1
    step_gamma: float = 0.95  # discount of the turn returns behind step advantages
    state_match: Literal["tokens", "env"] = "tokens"  # which states are the same: "tokens", the exact token ids
    # of the history before the turn; "env", the environment's info["state_key"] after the previous turn
    dynamic_sampling: bool = False  # DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): groups whose
    # scores are all equal (no advantage, no gradient) are dropped and more tasks are rolled out in their place;
    # the update keeps tasks_per_step groups (logged: grpo/dropped_groups, grpo/sampling_rounds)
    max_sampling_rounds: int = 3  # dynamic_sampling: rollouts of tasks_per_step tasks per step at most, the first
    # included; groups still missing after them are filled with dropped ones (zero advantage)
    tis_clip: float | None = None  # truncated importance sampling (Yao et al. 2025; algos/losses.tis_weights): each
    # token's policy loss times min(pi_old / pi_sampler, tis_clip), for a sampler that is not the trainer
    # (rollout.backend: vllm; 2.0 is the paper's C). None: off

    def __post_init__(self):
        check_log_with(self.log_with)
        if self.tis_clip is not None and self.tis_clip <= 0:
            raise ValueError(f"tis_clip must be > 0 (or None: off), got {self.tis_clip}")
        for name in ("tasks_per_step", "num_generations", "num_iterations", "mini_batch_size",
                     "gradient_accumulation_steps", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.temperature < math.inf:  # a comparison with NaN is False: NaN fails too
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        for name in ("epsilon", "epsilon_high"):  # the ratio clip; NaN fails too
            if getattr(self, name) is not None and not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if not 0 <= self.beta < math.inf:  # a negative beta would reward drifting away from the reference
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta}")
        if not 0 <= self.step_advantage_weight < math.inf or not 0 <= self.step_gamma <= 1:
            raise ValueError(f"step_advantage_weight must be >= 0 and step_gamma in [0, 1], got "
                             f"{self.step_advantage_weight} and {self.step_gamma}")
        if self.num_generations == 1 and self.advantage != "dr_grpo":
            warnings.warn("num_generations=1: every group has one episode, so every advantage is 0", stacklevel=3)

    @property
    def batch_size(self) -> int:
        return self.tasks_per_step * self.num_generations


class GRPOTrainer:
    """model: a causal LM or a PeftModel. The reference (only used when beta > 0) is the adapter-disabled
    model under LoRA, `ref_model` if given, else a frozen copy."""

    def __init__(self, config: GRPOConfig, model, tokenizer, ref_model=None, optimizer=None):
        self.config = config
        self.logprob_paths = FAST  # the exact logprob shortcuts (trainers/common.LogprobPaths)
        self.accelerator = make_accelerator(gradient_accumulation_steps=config.gradient_accumulation_steps,
                                            mixed_precision=config.mixed_precision, log_with=config.log_with,
                                            project_dir=config.project_dir)
        set_seed(config.seed + self.accelerator.process_index)  # each rank its own stream; rank 0 = one process
        self.tokenizer = tokenizer
        default_pad_token(tokenizer)
        self.is_peft_model = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        self.ref_model = None
        if config.beta > 0 and not self.is_peft_model:
            self.ref_model = (ref_model or copy.deepcopy(model)).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = optimizer_groups(params, config.learning_rate,
                                  [(norm_gain_parameters(model), config.norm_learning_rate)])
        self.optimizer = optimizer or torch.optim.Adam(groups, lr=config.learning_rate, eps=config.adam_eps)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        self.metrics_log = MetricsLog(None, self.accelerator)
        self.samples_log = SamplesLog(None)  # a job sets SamplesLog(run_dir/"samples.jsonl", ...) to sample episodes
        self._sample_tensors: dict = {}  # the last update's tensors, for samples_log
        self.current_step = 0
        self.rollout_backend = None  # None: sample with the policy (hf); a job sets a VLLMRollout (rollout.backend)
        if config.log_with:
            self.accelerator.init_trackers(config.tracker_project_name, config={
                k: v for k, v in asdict(config).items() if isinstance(v, (int, float, str, bool))},
                init_kwargs=config.tracker_kwargs)
        eval_mode(self.model)  # dropout off during rollouts and updates

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model)

    def train(self, env_factory: Callable, tasks: list[dict], steps: int | None = None,
              sampling: SamplingParams | None = None, metrics_path: str | None = None,
              callback: Callable[[int, dict], None] | None = None, progress: bool = True,
              score_hook: Callable[[list[Episode]], None] | None = None, checkpointer=None) -> list[dict]:
        """`steps` steps; each rolls out `num_generations` episodes for each of `tasks_per_step` tasks.

        checkpointer: an agentrl.checkpoint.Checkpointer (periodic checkpoints, signals, non-finite streaks).
        """
        cfg = self.config
        steps = cfg.steps if steps is None else steps
        sampling = sampling or SamplingParams(temperature=cfg.temperature)
        if abs(sampling.temperature - cfg.temperature) > 1e-9:
            raise ValueError(f"sampling temperature {sampling.temperature} != GRPOConfig.temperature {cfg.temperature}")
        self.metrics_log = resumed_metrics(self, metrics_path)
        cycler, history = resumed_cycler(self, tasks, cfg.seed), []
        bar = progress_bar(steps, cfg.advantage.upper(), progress and self.accelerator.is_main_process)
        for i in range(steps):
            sync_seconds, sampler = None, None
            if self.rollout_backend is not None:  # vLLM samples with this step's weights
                sync_seconds, sampler = self.rollout_backend.sync_weights(self.policy), self.rollout_backend.sample
            started = time.time()
            episodes = self._rollout_groups(cycler, env_factory, sampling, sampler, score_hook)
            sampled, extra = episodes, {}
            if cfg.dynamic_sampling:
                episodes, sampled, extra = self._informative_groups(episodes, cycler, env_factory, sampling, sampler,
                                                                    score_hook)
            stats = self._update(episodes)
            stats.update(extra)
            end_of_step(self, stats, episodes, sampled, time.time() - started - stats["time/update"], sync_seconds,
                        history, callback, checkpointer, bar, i == steps - 1, lambda st: {
                            "score": f"{st['grpo/mean_scores']:.2f}", "acc": f"{st['env/accuracy']:.2f}",
                            "zero_var": f"{st['grpo/zero_variance_groups']:.2f}"})
        if bar is not None:
            bar.close()
        return history

    def _rollout_groups(self, cycler, env_factory: Callable, sampling: SamplingParams, sampler,
                        score_hook) -> list[Episode]:
        """One rollout of num_generations episodes for each of tasks_per_step tasks (this process's share)."""
        cfg = self.config
        # Every rank draws the same tasks and keeps its own tasks_per_step of them (tasks, not episodes,
        # are split: a group never spans two ranks). Consecutive copies of a task form its group.
        global_tasks = cycler.draw(cfg.tasks_per_step * self.accelerator.num_processes)
        with self.accelerator.split_between_processes(global_tasks) as my_tasks:
            batch_tasks = [t for t in my_tasks for _ in range(cfg.num_generations)]
        with gathered_for_generation(self.accelerator, self.model):
            episodes = rollout(self.policy, self.tokenizer, env_factory, batch_tasks, sampling, sampler=sampler)
        if score_hook is not None:  # e.g. reward models adding to the environment's scores
            score_hook(episodes)
        return episodes

    def _informative_groups(self, episodes: list[Episode], cycler, env_factory: Callable, sampling: SamplingParams,
                            sampler, score_hook) -> tuple[list[Episode], list[Episode], dict]:
        """Dynamic sampling: (the episodes of tasks_per_step groups for the update, every episode sampled, stats).
        Groups whose scores (as the update sees them) are all equal are set aside and more are rolled out, up to
        max_sampling_rounds rollouts; set-aside groups fill whatever is still missing."""
        cfg, G = self.config, self.config.num_generations
        kept, spare, sampled, rounds = [], [], list(episodes), 1
        while True:
            for g in range(0, len(episodes), G):
                group = episodes[g:g + G]
                valid = [ep for ep in group if not ep.infra_failure]
                scores = self._scores(valid).tolist()
                (kept if len(valid) > 1 and max(scores) - min(scores) > 1e-8 else spare).append(group)
            missing = torch.tensor(float(cfg.tasks_per_step - len(kept)), device=self.accelerator.device)
            if self.accelerator.num_processes > 1:  # every rank rolls out as many rounds (collectives line up)
                missing = self.accelerator.reduce(missing, "max")
            if missing.item() <= 0 or rounds == cfg.max_sampling_rounds:
                break
            episodes = self._rollout_groups(cycler, env_factory, sampling, sampler, score_hook)
            sampled += episodes
            rounds += 1
        groups = (kept + spare)[: cfg.tasks_per_step]
        n = len(kept) + len(spare)
        stats = {"grpo/dropped_groups": len(spare) / n, "grpo/sampling_rounds": float(rounds),
                 "grpo/uninformative_groups_used": max(0, cfg.tasks_per_step - len(kept)) / cfg.tasks_per_step}
        return [ep for group in groups for ep in group], sampled, stats

    def _scores(self, episodes: list[Episode]) -> torch.Tensor:
        """(N,) episode scores as the update uses them (missing_eos_penalty applied)."""
        scores = torch.tensor([ep.score for ep in episodes])
        if self.config.missing_eos_penalty is not None:
            scores = scores - self.config.missing_eos_penalty * torch.tensor([float(ep.truncated) for ep in episodes])
        return scores

    def _step_advantages(self, episodes: list[Episode], valid: torch.Tensor, shape) -> tuple[torch.Tensor, dict]:
        """GiGPO's step advantages put on each turn's sampled tokens: (N, T-1) aligned with the TokenBatch, and
        stats (the share of turns whose state another episode of the group also reached: where it can help)."""
        cfg = self.config
        keys, returns, groups, rows = [], [], [], []
        for i, ep in enumerate(episodes):
            if not valid[i]:
                continue
            rows.append(i)
            groups.append(i // cfg.num_generations)
            returns.append(turn_returns(ep.turn_rewards, cfg.step_gamma))
            keys.append([self._state_key(ep, t) for t in range(ep.num_turns)])
        step = anchor_state_advantages(groups, keys, returns)
        out = torch.zeros(shape)
        for i, row in zip(rows, step):
            ep, n, turn = episodes[i], len(episodes[i].prompt_ids), 0
            for j, sampled in enumerate(ep.loss_mask):  # token j of token_ids is predicted at position n + j - 1
                while turn < len(ep.turn_ends) and ep.turn_ends[turn] < j:
                    turn += 1
                if sampled:
                    out[i, n + j - 1] = row[turn]
        counts: dict = {}
        for g, ks in zip(groups, keys):
            for k in ks:
                counts[(g, k)] = counts.get((g, k), 0) + 1
        shared = [counts[(g, k)] > 1 for g, ks in zip(groups, keys) for k in ks[1:]]  # turn 0: the task's prompt
        return out, {"grpo/step_states_shared": sum(shared) / max(len(shared), 1),
                     "grpo/step_advantages_abs_mean": sum(abs(a) for r in step for a in r)
                     / max(sum(map(len, step)), 1)}

    def _state_key(self, ep: Episode, turn: int):
        """The state before `turn`: the exact token ids of the history, or the environment's state_key."""
        if turn == 0:
            return "reset"  # every episode of a group starts from its task's prompt
        if self.config.state_match == "env":
            key = ep.state_keys[turn - 1]
            if key is None:
                raise ValueError("grpo.state_match='env' needs the environment to put info['state_key'] (a hashable "
                                 "description of the state) in every step's StepResult; it gave none")
            return key
        start = ep.turn_ends[turn - 1] + 1
        while start < len(ep.loss_mask) and not ep.loss_mask[start]:  # past the observation
            start += 1
        return tuple(ep.prompt_ids + ep.token_ids[:start])

    def advantages(self, scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) episode scores in consecutive groups -> (N,) advantages; `valid` (N,) False for episodes left out."""
        G = self.config.num_generations
        if self.config.advantage == "rloo":
            return rloo_advantages(scores, G, valid)
        return group_advantages(scores, G, normalize_std=self.config.advantage == "grpo", valid=valid)

    @torch.no_grad()
    def _ref_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return masked_logprobs(self.ref_model, batch, self.config.temperature,
                                   paths=self.logprob_paths)[0]
        with self.policy.disable_adapter():
            return masked_logprobs(self.policy, batch, self.config.temperature, paths=self.logprob_paths)[0]

    def _update(self, episodes: list[Episode]) -> dict[str, float]:
        cfg, t0 = self.config, time.time()
        eval_mode(self.model)
        scores = self._scores(episodes)
        # Episodes that failed outside the policy: out of the group baselines and (mask 0) out of the loss.
        valid = torch.tensor([not ep.infra_failure for ep in episodes])
        advantages = self.advantages(scores, None if valid.all() else valid)
        # A NaN or infinite score would otherwise become advantage 0 (its group's std is not > 0) and vanish: as in
        # PPO, it makes the loss of its mini-batch non-finite, so that step is skipped and counted
        # (train/skipped_nonfinite; max_nonfinite_steps in a row stop the run).
        bad = ~torch.isfinite(scores) & valid
        if bad.any():
            advantages = torch.where(bad, torch.full_like(advantages, float("nan")), advantages)
        full = episodes_to_batch(episodes, self.tokenizer.pad_token_id)
        check_batch(episodes, full)
        mask_infra_failures(episodes, full)
        step_stats = {}
        if cfg.step_advantage_weight > 0:  # (N, T-1): the episode's advantage plus the weighted step advantage
            step, step_stats = self._step_advantages(episodes, valid, full.loss_mask.shape)
            advantages = advantages[:, None] + cfg.step_advantage_weight * step
        advantages = advantages.to(self.accelerator.device)
        full = full.to(self.accelerator.device)  # loss_mask (B, T-1): 1 on sampled tokens; prompt, tool
        # observations and padding are 0
        old, ref = self._old_and_ref(full)
        # (N,) advantages: every sampled token of an episode gets its episode's; old only when num_iterations > 1
        self._sample_tensors = {"advantages": advantages, "ref_logprobs": ref, "trainer_logprobs": old}
        acc, nonfinite, at_rollout = self._optimize(full, advantages, old, ref)
        stats = {k: sum(v) / len(v) for k, v in acc.items()}
        if at_rollout and full.logprobs is not None:
            width = max(x.shape[1] for x, _, _ in at_rollout)
            pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
            stats.update(global_logprob_mismatch(self.accelerator, logprob_mismatch(
                *(torch.cat([pad(t[k]) for t in at_rollout]) for k in range(3)), cfg.logprob_mismatch_threshold)))
        all_scores = scores if self.accelerator.num_processes == 1 else self.accelerator.gather(
            scores.to(self.accelerator.device)).cpu()  # every rank's episodes, groups whole, in rank order
        stats.update({
            "train/skipped_nonfinite": float(nonfinite),
            "grpo/mean_scores": all_scores.mean().item(),
            "grpo/std_scores": all_scores.std(unbiased=False).item(),
            "grpo/zero_variance_groups": zero_variance_fraction(all_scores, cfg.num_generations),
            "grpo/advantages_abs_mean": (advantages.abs().mean() if advantages.dim() == 1 else
                                         masked_mean(advantages.abs(), full.loss_mask)).item(),
            **step_stats,
            "grpo/learning_rate": self.optimizer.param_groups[0]["lr"],
            "time/update": time.time() - t0,
        })
        # The per-rank means (same number of episodes on every rank); the score stats above are global already.
        stats = mean_over_processes(self.accelerator, stats, [*acc, "train/skipped_nonfinite",
                                                              "grpo/advantages_abs_mean"])
        self.current_step += 1
        return stats

    @torch.no_grad()
    def _old_and_ref(self, full: TokenBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(B, T-1) logprobs before the update, when num_iterations > 1 (with one pass old = current, detached: no
        extra forward), and the reference's when beta > 0; else None. At the update's precision (mixed_precision),
        as PPO's: under bf16 autocast an fp32 forward here would cost twice as much and put bf16 rounding into the
        first ratios."""
        cfg = self.config
        chunks = [torch.arange(s, min(s + cfg.mini_batch_size, len(full)))
                  for s in range(0, len(full), cfg.mini_batch_size)]
        old = ref = None
        if cfg.num_iterations > 1:
            with self.accelerator.autocast():
                old = torch.zeros_like(full.loss_mask)
                for idx in chunks:
                    mb = full.select(idx)
                    old[idx, : mb.loss_mask.shape[1]] = masked_logprobs(
                        self.model, mb, cfg.temperature, paths=self.logprob_paths)[0]
        if cfg.beta > 0:
            ref = torch.zeros_like(full.loss_mask)
            # FSDP / ZeRO-3: the unwrapped reference, with whole weights
            with gathered_for_generation(self.accelerator, self.model), self.accelerator.autocast():
                for idx in chunks:
                    mb = full.select(idx)
                    ref[idx, : mb.loss_mask.shape[1]] = self._ref_logprobs(mb)
        return old, ref

    def _optimize(self, full: TokenBatch, advantages: torch.Tensor, old, ref) -> tuple[dict, int, list]:
        """num_iterations passes of clipped updates over shuffled mini-batches. Returns (per-mini-batch stats,
        non-finite steps skipped, (logprobs, sampler's logprobs, mask) at the rollout's weights)."""
        cfg = self.config
        acc = defaultdict(list)
        # Logprobs at the rollout's weights: `old` when computed, else the forwards before the first optimizer
        # step (the first gradient_accumulation_steps mini-batches), compared with the sampler's.
        at_rollout = [] if old is None else [(old, full.logprobs, full.loss_mask)]
        nonfinite = 0
        for it in range(cfg.num_iterations):
            perm = torch.randperm(len(full))
            for start in range(0, len(full), cfg.mini_batch_size):
                idx = perm[start:start + cfg.mini_batch_size]
                mb = full.select(idx)
                w = mb.loss_mask.shape[1]
                with self.accelerator.accumulate(self.model):
                    with self.accelerator.autocast():
                        # Only sampled positions reach the LM head; each group's prompt runs once.
                        logprobs, entropy = masked_logprobs(self.model, mb, cfg.temperature, with_entropy=True,
                                                            paths=self.logprob_paths)
                    if old is None and it == 0 and start < cfg.mini_batch_size * cfg.gradient_accumulation_steps:
                        at_rollout.append((logprobs.detach(), mb.logprobs, mb.loss_mask))
                    mb_old = logprobs.detach() if old is None else old[idx, :w]
                    tis = None  # truncated importance weights (B, T-1), with tis_clip and the sampler's logprobs
                    if cfg.tis_clip is not None and mb.logprobs is not None:
                        tis, tis_stats = tis_weights(mb_old, mb.logprobs, mb.loss_mask, cfg.tis_clip)
                        for k, v in tis_stats.items():
                            acc[f"tis/{k}"].append(v.item())
                    mb_adv = advantages[idx] if advantages.dim() == 1 else advantages[idx, :w]
                    loss, st = grpo_loss(logprobs, mb_old, mb_adv, mb.loss_mask, cfg.epsilon,
                                         cfg.epsilon_high, cfg.beta, None if ref is None else ref[idx, :w],
                                         cfg.loss_aggregation, tis)
                    # Several processes, token_mean: a mean over the global mini-batch's tokens. (sequence_mean
                    # needs nothing: every rank has as many sequences, and DDP averages their means.)
                    scale = global_token_scale(self.accelerator, mb.loss_mask) if cfg.loss_aggregation == "token_mean" \
                        else None
                    if scale is not None:
                        loss = loss * scale
                    nonfinite += guarded_step(self.accelerator, self.model, self.optimizer, loss, cfg.max_grad_norm)
                    self.optimizer.zero_grad(set_to_none=True)
                entropy = masked_mean(entropy, mb.loss_mask)
                acc["grpo/loss"].append(loss.item())
                acc["policy/clipfrac"].append(st["clipfrac"].item())
                acc["policy/kl"].append(st["kl"].item())
                acc["grpo/ratio"].append(st["ratio"].item())
                acc["policy/entropy"].append(entropy.item())
        return acc, nonfinite, at_rollout

    # --- checkpoints (agentrl.checkpoint) ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (weights, optimizer, RNGs, task position, ...)."""
        return trainer_state(self)

    def load_state_dict(self, state: dict) -> None:
        load_trainer_state(self, state)

    def save_checkpoint(self, directory: str) -> None:
        save_trainer_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(self, directory)

    def save_pretrained(self, save_directory: str) -> None:
        """Write the policy (adapter under LoRA; model + tokenizer otherwise) atomically, refusing NaNs."""
        save_weights(self.accelerator, self.model, save_directory, lambda tmp, full: write_lm(
            self.policy, tmp, full, None if self.is_peft_model else self.tokenizer))
