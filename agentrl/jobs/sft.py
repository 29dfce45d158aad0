"""The SFT job behind `agentrl sft`: demonstrations -> a model directory that RL trains directly.

    agentrl sft --config quickstart env.name=M:Env env.tasks=M:tasks env.demonstrations=M:demos out_dir=DIR
    agentrl ppo --config quickstart env.name=M:Env env.tasks=M:tasks model.base=DIR/model out_dir=DIR2

The demonstrations are `sft.data` (a JSONL file), or `env.demonstrations` drawn over the environment's
training tasks (held-out tasks removed first, as in PPO). `model.base: embedded` trains a fresh tiny model
whose tokenizer is learned from the demonstrations; a model directory is fine-tuned (LoRA, merged after, or
full). Either way DIR/model is a plain model directory with its tokenizer, evaluated on the held-out tasks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentrl.config import ConfigError, load_config, to_dict
from agentrl.jobs.common import (EnvSection, ModelSection, RolloutSection, Run, add_lora, env_demonstrations,
                                 environment_factory, eval_key, load_base, renders_chat, resolve_config_path,
                                 store_eval, tasks_of)
from agentrl.jobs.ppo import JobConfig, resolve_precisions, retention_after, retention_before
from agentrl.trainers.sft import SFTConfig


@dataclass
class SFTJobConfig:
    """What `agentrl sft` runs on. Its file is the training job's (one file holds the SFT -> RL recipe, e.g.
    configs/real.yaml): load_sft_job checks the whole file against the training job's schema and takes these."""

    model: ModelSection = field(default_factory=ModelSection)
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sft: SFTConfig = field(default_factory=SFTConfig)
    out_dir: str = "runs/sft"  # DIR/model, metrics.jsonl and summary.json
    eval_seed: int = 0  # seed of the held-out task draw and of sampled evaluation
    # The held-out evaluation's sampling temperature and precision. load_sft_job takes those of the trainer the
    # file names (`algo`), so the RL job that starts from DIR/model reads this evaluation as its `before`.
    eval_temperature: float = 1.0
    eval_precision: str = "no"
    progress: bool = True
    retention_base: str | None = None  # see JobConfig.retention_base


def sft_job_of(job: JobConfig) -> SFTJobConfig:
    """The SFT job of a training job's config (its sections, and its trainer's evaluation settings)."""
    trainer = job.ppo if job.algo == "ppo" else job.grpo
    return SFTJobConfig(model=job.model, env=job.env, rollout=job.rollout, sft=job.sft, out_dir=job.out_dir,
                        eval_seed=job.eval_seed, eval_temperature=trainer.temperature,
                        eval_precision=trainer.mixed_precision, progress=job.progress,
                        retention_base=job.retention_base)


def load_sft_job(path: str | None, overrides: list[str] | None = None) -> SFTJobConfig:
    """`agentrl sft --config FILE key=value ...`: out_dir defaults to runs/sft, not the training job's runs/ppo."""
    job = load_config(JobConfig, resolve_config_path(path) if path else None, overrides,
                      defaults={"out_dir": SFTJobConfig.out_dir})
    return sft_job_of(resolve_precisions(job))


def demonstrations_of(config: SFTJobConfig, eval_tasks: list[dict]) -> tuple[object, str]:
    """(the SFT data: a JSONL path or a list of rows, its name in error messages)."""
    if config.sft.data:
        return config.sft.data, config.sft.data
    if config.env.demonstrations:
        n = config.sft.steps * config.sft.batch_size  # a fresh draw per example: every pass differs
        return (env_demonstrations(config.env, n, config.sft.seed, eval_tasks),
                f"env.demonstrations ({config.env.demonstrations})")
    raise ConfigError("sft.data / env.demonstrations: no demonstrations to learn; set sft.data=FILE.jsonl or "
                      "env.demonstrations=module:function")


def with_replay(data, name: str, sft, model, tokenizer, max_new_tokens: int) -> tuple[list, str]:
    """The demonstrations with the model's own answers to general instructions mixed in (sft.replay_fraction of
    the rows, the replay rows cycled and spread evenly through the rows)."""
    from agentrl.jobs.retention import replay_demonstrations
    from agentrl.trainers.sft import read_demonstrations

    task_rows = [row for _, row in read_demonstrations(data, name)]
    replay = replay_demonstrations(model, tokenizer, max_new_tokens=max(max_new_tokens, 64))
    n_replay = round(len(task_rows) * sft.replay_fraction / (1 - sft.replay_fraction))
    mixed, k = [], 0
    for i, row in enumerate(task_rows):
        mixed.append(row)
        while k < n_replay and (k + 1) * len(task_rows) <= (i + 1) * n_replay:
            mixed.append(replay[k % len(replay)])
            k += 1
    return mixed, f"{name} + {n_replay} replay rows"


def run_sft_job(config: SFTJobConfig) -> dict:
    """Demonstrations -> SFT -> `out_dir/model` (+ metrics.jsonl, summary.json with held-out metrics). Holds
    out_dir's lock while it runs, as the other jobs do (a second job there would interleave metrics.jsonl)."""
    from agentrl.checkpoint import check_replaceable
    from agentrl.jobs.run import lock_run, unlock_run

    lock_run(config.out_dir)
    try:
        check_replaceable(Path(config.out_dir) / "model", "out_dir")
        return _sft_job(config)
    finally:
        unlock_run(config.out_dir)


def _sft_job(config: SFTJobConfig) -> dict:
    import torch

    from agentrl.checkpoint import write_json
    from agentrl.jobs.run import run_config
    from agentrl.jobs.base_model import META_FILE, build_from_demonstrations
    from agentrl.trainers.sft import SFTTrainer

    started = time.time()
    out, sft = Path(config.out_dir), replace(config.sft, progress=config.progress)
    fingerprint, retention = run_config(to_dict(config)), None
    env_factory = environment_factory(config.env)
    eval_tasks = tasks_of(config.env, config.env.eval_tasks, config.eval_seed, "eval")
    data, name = demonstrations_of(config, eval_tasks)
    model_dir = out / "model"
    if config.model.base == "embedded":
        build_from_demonstrations(model_dir, data, config.model.builder, sft, renders_chat(env_factory()), name,
                                  config.progress, str(out / "metrics.jsonl"))
        meta = json.loads((model_dir / META_FILE).read_text())
        trained = {k: meta[k] for k in ("final_loss", "demonstrations", "skipped_rows", "truncated_rows",
                                        "demo_exact_match", "trained_steps", "train_seconds")}
    else:
        model, tokenizer = load_base(config.model.base, config.model)
        retention = retention_before(config, out, fingerprint, model)
        if sft.replay_fraction > 0:
            data, name = with_replay(data, name, sft, model, tokenizer, config.rollout.max_new_tokens)
        torch.manual_seed(sft.seed)
        trainer = SFTTrainer(add_lora(model, config.model), sft, data, tokenizer, dataset_name=name)
        train_started = time.time()
        history = trainer.train(metrics_path=str(out / "metrics.jsonl"))
        trainer.save_model(str(model_dir))
        trained = {"final_loss": history[-1]["loss"], "demonstrations": len(trainer.examples),
                   "skipped_rows": trainer.skipped_rows, "truncated_rows": trainer.truncated_rows,
                   "train_seconds": round(time.time() - train_started, 1)}
    model, tokenizer = load_base(str(model_dir))
    retention = retention_after(retention, out, fingerprint, model)
    run = Run(str(model_dir), model, tokenizer, env_factory, eval_tasks, config.eval_seed, config.rollout)
    after = run.evaluate_both(model, config.eval_temperature, config.eval_precision)
    store_eval(str(model_dir), eval_key(config.env, config.eval_seed, config.rollout, config.eval_temperature,
                                        config.eval_precision), after)
    summary = {"after": after["greedy"], "after_sampled": after["sampled"], "algo": "sft", "steps": sft.steps,
               **trained, "eval_tasks": len(eval_tasks), "wall_seconds": round(time.time() - started, 1),
               "model_dir": str(model_dir), "config": to_dict(config)}
    if retention is not None:
        summary["retention"] = retention
    write_json(out / "summary.json", summary)
    return summary

