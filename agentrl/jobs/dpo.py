"""The DPO job behind `agentrl dpo` / `make demo-dpo`: offline DPO on a pairs file, or iterative DPO from
environment feedback (seed 003's 迭代式DPO): rounds of sample -> score -> pair -> DPO."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from agentrl.config import load_config, to_dict
from agentrl.jobs.common import (EnvSection, ModelSection, RolloutSection, add_lora, prepare_run, resolve_config_path,
                                 training_tasks)
from agentrl.trainers.dpo import DPOConfig


@dataclass
class IterativeSection:
    rounds: int = 3  # sample -> pair -> DPO rounds (ignored when `data` is set)
    tasks_per_round: int = 256  # tasks sampled per round
    samples: int = 4  # trajectories per task (K); chosen = best, rejected = worst, ties skipped
    reference: Literal["previous", "base"] = "previous"  # reference of each round: last round's policy or the base
    temperature: float = 1.0  # sampling temperature of the rollouts


@dataclass
class DPOJobConfig:
    data: str | None = None  # a pairs file / datasets dir / name for offline DPO; None: iterative from `env`
    model: ModelSection = field(default_factory=ModelSection)
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    iterative: IterativeSection = field(default_factory=IterativeSection)
    out_dir: str = "runs/dpo"  # adapter, pairs, metrics, samples.jsonl and summary.json go here
    eval_seed: int = 0  # seed of the held-out draw and of sampled evaluation
    progress: bool = True  # progress bars
    sample_every: int = 1  # iterative: write chosen/rejected pairs to samples.jsonl every this many rounds
    samples_per_step: int = 4  # pairs written per sampled round (0: no samples.jsonl)


def load_dpo_job(path: str | None, overrides: list[str] | None = None) -> DPOJobConfig:
    return load_config(DPOJobConfig, resolve_config_path(path) if path else None, overrides)


def run_dpo_job(config: DPOJobConfig) -> dict:
    import torch

    from agentrl.checkpoint import write_json, write_jsonl
    from agentrl.jobs.preferences import sample_pairs
    from agentrl.preferences import pair_to_example
    from agentrl.rollout.sampling import SamplingParams
    from agentrl.samples import SamplesLog
    from agentrl.trainers.common import TaskCycler
    from agentrl.trainers.dpo import DPOTrainer

    started = time.time()
    out = Path(config.out_dir)
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, config.progress)
    model, tokenizer, env_factory = run.model, run.tokenizer, run.env_factory
    max_new = config.rollout.max_new_tokens
    before = run.evaluate_both(model, config.iterative.temperature)
    torch.manual_seed(config.dpo.seed)  # LoRA init and rollouts: the same run for the same config
    model = add_lora(model, config.model)
    dpo_cfg = replace(config.dpo, output_dir=str(out / "adapter"), progress=config.progress,
                      logging_dir=config.dpo.logging_dir or str(out))
    samples = SamplesLog(out / "samples.jsonl", tokenizer, config.sample_every,
                         config.samples_per_step if config.data is None else 0, source="iterative-dpo")
    rounds, total_pairs, total_ties, trainer, steps = [], 0, 0, None, 0
    train_started = time.time()
    if config.data is not None:
        trainer = DPOTrainer(model=model, args=dpo_cfg, train_dataset=config.data, tokenizer=tokenizer)
        trainer.train(metrics_path=str(out / "metrics.jsonl"))
        trainer.accelerator.end_training()  # flush and close the trackers' files
        total_pairs, steps = len(trainer.examples), trainer.total_steps
    else:
        cycler = TaskCycler(training_tasks(config.env, dpo_cfg.seed, run.eval_tasks), dpo_cfg.seed)
        sampling = SamplingParams(max_new_tokens=max_new, temperature=config.iterative.temperature,
                                  top_k=config.rollout.top_k, top_p=config.rollout.top_p)
        for r in range(config.iterative.rounds):
            model.eval()
            pairs, ties, rows = sample_pairs(model, tokenizer, env_factory, cycler.draw(config.iterative.tasks_per_round),
                                             config.iterative.samples, sampling)
            write_jsonl(out / f"pairs-round{r}.jsonl", rows)
            samples.write_pairs(r, pairs)
            total_pairs, total_ties = total_pairs + len(pairs), total_ties + ties
            record = {"round": r, "pairs": len(pairs), "ties_skipped": ties,
                      "mean_chosen_score": sum(b.score for b, _ in pairs) / max(len(pairs), 1),
                      "mean_rejected_score": sum(w.score for _, w in pairs) / max(len(pairs), 1)}
            if pairs:
                # Reference logprobs precomputed by the policy as it is now ("previous") or by the base.
                round_cfg = replace(dpo_cfg, precompute_ref_log_probs=True,
                                    reference_with_adapter=config.iterative.reference == "previous")
                trainer = DPOTrainer(model=model, args=round_cfg, tokenizer=tokenizer,
                                     train_dataset=[pair_to_example(b, w) for b, w in pairs])
                history = trainer.train(metrics_path=str(out / f"metrics-round{r}.jsonl"))
                trainer.accelerator.end_training()
                steps += trainer.total_steps
                record.update({k: history[-1][k] for k in ("loss", "rewards/accuracies", "rewards/margins")})
            rounds.append(record)
    train_seconds = time.time() - train_started
    adapter_dir = Path(dpo_cfg.output_dir)
    if trainer is None:
        raise RuntimeError("no preference pairs were produced in any round; nothing to train on")
    trainer.save_model(str(adapter_dir))
    after = run.evaluate_both(model, config.iterative.temperature)
    summary = {
        "before": before["greedy"], "after": after["greedy"],
        "before_sampled": before["sampled"], "after_sampled": after["sampled"],
        "algo": "dpo" if config.data else "iterative-dpo", "steps": steps, "ppo_steps": 0,
        "rounds": rounds, "pairs": total_pairs, "ties_skipped": total_ties,
        "eval_tasks": len(run.eval_tasks), "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - started, 1),
        "base_model_dir": str(run.base_dir), "adapter_dir": str(adapter_dir), "config": to_dict(config),
    }
    write_json(out / "summary.json", summary)
    return summary
