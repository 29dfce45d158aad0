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
from dataclasses import replace
from pathlib import Path

from agentrl.config import ConfigError, to_dict
from agentrl.jobs.common import (Run, add_lora, env_demonstrations, environment_factory, eval_key, load_base,
                                 renders_chat, store_eval, tasks_of)
from agentrl.jobs.ppo import JobConfig, retention_after, retention_before


def demonstrations_of(config: JobConfig, eval_tasks: list[dict]) -> tuple[object, str]:
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


def run_sft_job(config: JobConfig) -> dict:
    """Demonstrations -> SFT -> `out_dir/model` (+ metrics.jsonl, summary.json with held-out metrics)."""
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
    run = Run(str(model_dir), model, tokenizer, env_factory, eval_tasks, config.rollout.max_new_tokens, config.eval_seed,
              config.rollout.max_context, config.rollout.max_observation_tokens)
    # At the precision PPO will train and evaluate at (ppo.mixed_precision), so that its `before` is this one.
    after = run.evaluate_both(model, config.ppo.temperature, config.ppo.mixed_precision)
    store_eval(str(model_dir), eval_key(config.env, config.eval_seed, config.rollout,
                                        config.ppo.temperature, config.ppo.mixed_precision), after)
    summary = {"after": after["greedy"], "after_sampled": after["sampled"], "algo": "sft", "steps": sft.steps,
               **trained, "eval_tasks": len(eval_tasks), "wall_seconds": round(time.time() - started, 1),
               "model_dir": str(model_dir), "config": to_dict(config)}
    if retention is not None:
        summary["retention"] = retention
    write_json(out / "summary.json", summary)
    return summary

