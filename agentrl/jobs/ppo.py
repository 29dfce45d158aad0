"""The PPO job behind `agentrl ppo` and `agentrl quickstart`: base model -> eval -> PPO -> eval -> save."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.config import ConfigError, load_config, to_dict
from agentrl.judge import JudgeSection, check_judge, judge_hook
from agentrl.jobs.common import (EnvSection, ModelSection, RolloutSection, add_lora, env_demonstrations, eval_key,
                                 held_out_summary, prepare_run, resolve_config_path, rollout_sampling, stored_eval,
                                 summary_config, warn_ineffective)
from agentrl.samples import SamplesLog
from agentrl.trainers.grpo import GRPOConfig
from agentrl.trainers.ppo import PPOConfig
from agentrl.trainers.sft import SFTConfig


@dataclass
class RewardSection:
    models: list[str] = field(default_factory=list)  # reward-model directories (agentrl reward-model); empty: env only
    weight: float = 1.0  # weight of the (combined) reward-model score
    env_weight: float = 1.0  # weight of the environment's score (0: reward models instead of the environment)
    combine: Literal["mean", "min"] = "mean"  # how several reward models are combined
    judge: JudgeSection = field(default_factory=JudgeSection)  # an LLM judge's score (agentrl/judge.py, docs/judge.md)


@dataclass
class JobConfig:
    algo: Literal["ppo", "grpo"] = "ppo"  # which trainer runs; its section (ppo or grpo) configures it
    model: ModelSection = field(default_factory=ModelSection)
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardSection = field(default_factory=RewardSection)
    sft: SFTConfig = field(default_factory=SFTConfig)  # `agentrl sft`, and the embedded model of env.demonstrations
    steps: int = 60  # training steps (each of ppo.batch_size, or grpo.tasks_per_step * num_generations, episodes)
    out_dir: str = "runs/ppo"  # adapter, metrics.jsonl, samples.jsonl and summary.json go here
    eval_seed: int = 0  # seed of the held-out task draw and of sampled evaluation
    progress: bool = True  # progress bars
    checkpoint_every: int = 10  # checkpoint every this many steps, after the last and on SIGTERM/SIGINT (0: never)
    keep_checkpoints: int = 2  # newest checkpoints kept in out_dir/checkpoints
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a non-finite loss or gradient (0: never)
    resume: str | None = None  # "auto": the latest valid checkpoint in out_dir (fresh if none); or a checkpoint path
    sample_every: int = 10  # write episodes to samples.jsonl at step 1 and every this many steps
    samples_per_step: int = 4  # episodes written per sampled step (0: no samples.jsonl)
    retention_base: str | None = None  # a model whose greedy answers to 50 general prompts the policy is scored
    # on before and after training (NLL, KL; jobs/retention.py): what the model knew, kept or forgotten. None: off


def trackers_in_run_dir(algo_config, out: Path) -> None:
    """Trackers write into the run directory unless told otherwise: TensorBoard events under
    out/<tracker_project_name>/, W&B (offline or not) under out/wandb/."""
    if not algo_config.log_with:
        return
    if algo_config.project_dir is None:
        algo_config.project_dir = str(out)
    if "wandb" in str(algo_config.log_with):
        algo_config.tracker_kwargs.setdefault("wandb", {}).setdefault("dir", str(out))


def run_job(config: JobConfig) -> dict:
    """Build or load the base model, evaluate, train (PPO or GRPO), evaluate again, save; returns the summary.

    With `resume`, continues from a checkpoint of out_dir: stored evaluations are reused, metrics.jsonl is cut
    back to the checkpoint's rows, and training continues exactly where the checkpoint left it.
    """
    import torch

    from agentrl.checkpoint import write_json
    from agentrl.jobs.run import cached_eval, job_checkpointer, open_run, run_config
    from agentrl.distributed import end_processes, finish_trackers, is_main_process, partial_state, world_banner
    started = time.time()
    partial_state()  # first: under torchrun without a GPU, the CPU process group (see agentrl.distributed)
    if is_main_process():
        print(f"agentrl: {world_banner()}", flush=True)
    out = Path(config.out_dir)
    resolve_precisions(config)
    warn_ineffective(config, config.algo)
    check_judge(config.reward.judge)
    fingerprint = run_config(to_dict(config))
    state = open_run(out, config.resume, fingerprint)
    checkpointer = job_checkpointer(out, config, job_state=lambda: {"config": fingerprint})
    with checkpointer.signals():
        run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, config.progress, config.sft)
        model, tokenizer, env_factory, eval_tasks = run.model, run.tokenizer, run.env_factory, run.eval_tasks
        algo_config = config.ppo if config.algo == "ppo" else config.grpo
        train_tasks = run.train_tasks(config.env, config.env.train_tasks, algo_config.seed)
        key = eval_key(config.env, config.eval_seed, config.rollout, algo_config.temperature,
                       algo_config.mixed_precision)
        precision = algo_config.mixed_precision
        before = cached_eval(out, "before", fingerprint, lambda: stored_eval(run.base_dir, key)
                             or run.evaluate_both(model, algo_config.temperature, precision))
        retention = retention_before(config, out, fingerprint, model)
        torch.manual_seed(algo_config.seed)
        model = add_lora(model, config.model)
        trackers_in_run_dir(algo_config, out)
        trainer = make_trainer(config, model, tokenizer, len(train_tasks), eval_tasks)
        resume_trainer(trainer, state, checkpointer, config, out, tokenizer)
        vllm_startup = None  # rollout.backend vllm: an engine in this process samples with the policy's weights
        if config.rollout.backend == "vllm":
            trainer.rollout_backend = vllm_rollout(config, run.base_dir, algo_config.seed)
            vllm_startup = round(trainer.rollout_backend.startup_seconds, 1)
        remaining = config.steps - trainer.current_step
        if remaining < 0:
            raise ConfigError(f"steps={config.steps}, but the checkpoint resumed from is at step "
                              f"{trainer.current_step}")
        sampling = rollout_sampling(config.rollout, algo_config.temperature)
        score_hook, judge = score_hooks(config, tokenizer, out)
        ppo_started = time.time()
        with checkpointer.loop():
            trainer.train(env_factory, train_tasks, steps=remaining, sampling=sampling,
                          metrics_path=str(out / "metrics.jsonl"), progress=config.progress, score_hook=score_hook,
                          checkpointer=checkpointer)
        ppo_seconds = time.time() - ppo_started
        finish_trackers(trainer.accelerator)
        adapter_dir = out / ("adapter" if config.model.lora else "model")
        trainer.save_pretrained(str(adapter_dir))
        after = cached_eval(out, "after", fingerprint, lambda: evaluate_trained(run, trainer, algo_config.temperature,
                                                                                precision))
        retention = retention_after(retention, out, fingerprint, trainer.policy)
    if not is_main_process():  # every process evaluated its share; the main one writes the summary
        end_processes()
        return None
    procs = trainer.accelerator.num_processes
    summary = {
        **held_out_summary(before, after),
        "algo": config.algo, "steps": config.steps, "ppo_steps": config.steps if config.algo == "ppo" else 0,
        "episodes": config.steps * algo_config.batch_size * procs, "num_processes": procs,
        "eval_tasks": len(eval_tasks), "train_seconds": round(ppo_seconds, 1),
        "wall_seconds": round(time.time() - started, 1),
        "base_model_dir": str(run.base_dir), "adapter_dir": str(adapter_dir), "config": summary_config(config),
        **({} if vllm_startup is None else {"vllm_startup_seconds": vllm_startup}),
        **({} if retention is None else {"retention": retention}),
        **({} if judge is None else {"judge": judge.summary()}),
    }
    write_json(out / "summary.json", summary)
    end_processes()
    return summary


def score_hooks(config: JobConfig, tokenizer, out: Path):
    """(the hook that rescores episodes, or None; the judge, or None): reward models, then the judge, whose
    weight applies to the score they left; verdicts are cached in out/judge-cache.jsonl."""
    score_hook = reward_model_hook(config, tokenizer)
    judge = judge_hook(config.reward.judge, tokenizer, out)
    if judge is not None:
        score_hook = judge if score_hook is None else _chain(score_hook, judge)
    return score_hook, judge


def make_trainer(config: JobConfig, model, tokenizer, n_train_tasks: int, eval_tasks: list[dict]):
    """The job's PPO or GRPO trainer (PPO-ptx on the environment's demonstrations when asked)."""
    from agentrl.trainers.grpo import GRPOTrainer
    from agentrl.trainers.ppo import PPOTrainer

    if config.algo != "ppo":
        return GRPOTrainer(config.grpo, model, tokenizer)
    trainer = PPOTrainer(config=config.ppo, model=model, tokenizer=tokenizer)
    if config.ppo.ptx_coef > 0 and config.ppo.ptx_data == "env":  # PPO-ptx on the environment's demonstrations
        if not config.env.demonstrations:
            raise ConfigError("ppo.ptx_data: 'env' needs env.demonstrations (module:function(task, rng))")
        trainer.set_ptx_data(env_demonstrations(config.env, n_train_tasks, config.ppo.seed, eval_tasks),
                             f"env.demonstrations ({config.env.demonstrations})")
    return trainer


def resume_trainer(trainer, state: dict | None, checkpointer, config: JobConfig, out: Path, tokenizer) -> None:
    """The checkpoint's trainer state, when resuming, and the samples log (cut back to the checkpoint's size)."""
    if state is not None:
        trainer.load_state_dict(state["trainer"])
        checkpointer.restore(state)
    trainer.samples_log = SamplesLog(out / "samples.jsonl", tokenizer, config.sample_every, config.samples_per_step,
                                     trainer.accelerator, source=config.algo,
                                     resume_bytes=state["trainer"]["samples_bytes"] if state else None)


def reward_model_hook(config: JobConfig, tokenizer):
    """reward.models as a score hook (their scores added to the environment's), or None."""
    if not config.reward.models:
        return None
    from agentrl.trainers.reward import RewardModelScorer

    return RewardModelScorer(config.reward.models, tokenizer, config.reward.weight, config.reward.env_weight,
                             config.reward.combine)


def _chain(*hooks):
    def hook(episodes):
        for h in hooks:
            h(episodes)
    return hook


def retention_before(config, out: Path, fingerprint: dict, model) -> dict | None:
    """retention_base's answers to the general prompts, scored under the model before training: {"reference",
    "before", "scorer"} (the scorer measures the trained policy in retention_after). None when off."""
    if not config.retention_base:
        return None
    from agentrl.jobs.run import cached_eval
    from agentrl.jobs.retention import Retention
    from agentrl.models.pretrained import resolve_model_dir

    scorer = Retention(resolve_model_dir(config.retention_base), max_new_tokens=config.rollout.max_new_tokens)
    before = cached_eval(out, "retention-before", fingerprint, lambda: scorer.measure(model))
    return {"reference": scorer.reference, "before": before, "scorer": scorer}


def retention_after(retention: dict | None, out: Path, fingerprint: dict, policy) -> dict | None:
    """The summary's retention entry: the reference's own scores, the policy's before and after training, and
    the relative rise of the NLL of the reference's answers from the reference to the trained policy."""
    if retention is None:
        return None
    from agentrl.jobs.run import cached_eval

    scorer = retention.pop("scorer")
    retention["after"] = after = cached_eval(out, "retention-after", fingerprint, lambda: scorer.measure(policy))
    retention["nll_rise"] = round(after["nll"] / retention["reference"]["nll"] - 1, 4)
    return retention


def evaluate_trained(run, trainer, temperature: float, mixed_precision: str = "no") -> dict:
    """run.evaluate_both on the trained policy, on every process, with whole weights under FSDP / ZeRO-3."""
    from agentrl.distributed import gathered_for_generation

    with gathered_for_generation(trainer.accelerator, trainer.model):
        return run.evaluate_both(trainer.policy, temperature, mixed_precision)


def vllm_rollout(config: JobConfig, base_dir: str, seed: int):
    """The colocated vLLM engine of rollout.backend=vllm, on the base model directory (weights synced each step)."""
    from agentrl.rollout.vllm_backend import VLLMRollout

    if config.model.load_in_4bit:
        raise ConfigError("rollout.backend: vllm gets merged full-precision weights each step; it does not work with "
                          "model.load_in_4bit (use rollout.backend=hf, or model.dtype=bfloat16)")
    rollout = config.rollout
    dtype = config.model.dtype if rollout.vllm_dtype == "auto" else rollout.vllm_dtype
    return VLLMRollout(base_dir, dtype, rollout.vllm_gpu_memory_utilization, rollout.vllm_max_model_len, seed,
                       rollout.vllm_enforce_eager)


def load_job(path: str | None, overrides: list[str] | None = None, command: dict | None = None) -> JobConfig:
    """The job config of a YAML file (a shipped name or a path) and overrides (`command`: keys the command fixes,
    see load_config), with `mixed_precision: auto` resolved (resolve_precisions)."""
    return resolve_precisions(load_config(JobConfig, resolve_config_path(path) if path else None, overrides,
                                          command=command))


def resolve_precisions(config: JobConfig) -> JobConfig:
    """`mixed_precision: auto` of the ppo, grpo and sft sections -> what this machine runs natively, before anything
    reads it: the SFT job's stored evaluation and the PPO job's `before` are keyed by the same value."""
    from agentrl.precision import resolve_mixed_precision

    for section in (config.ppo, config.grpo, config.sft):
        if section.mixed_precision == "auto":
            section.mixed_precision = resolve_mixed_precision("auto")
    return config
