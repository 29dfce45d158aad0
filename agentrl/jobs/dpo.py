"""The DPO job behind `agentrl dpo` / `make demo-dpo`: offline DPO on a pairs file, or iterative DPO from
environment feedback (seed 003's 迭代式DPO): rounds of sample -> score -> pair -> DPO."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from agentrl.config import load_config, to_dict
from agentrl.jobs.common import (EnvSection, ModelSection, RolloutSection, add_lora, held_out_summary, prepare_run,
                                 resolve_config_path, summary_config, warn_ineffective)
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
    checkpoint_every: int = 10  # checkpoint every this many DPO steps, after sampling each round, after the
    # last step and on SIGTERM/SIGINT (0: never)
    keep_checkpoints: int = 2  # newest checkpoints kept in out_dir/checkpoints
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a non-finite loss or gradient (0: never)
    resume: str | None = None  # "auto": the latest valid checkpoint in out_dir (fresh if none); or a checkpoint path
    sample_every: int = 1  # iterative: write chosen/rejected pairs to samples.jsonl every this many rounds
    samples_per_step: int = 4  # pairs written per sampled round (0: no samples.jsonl)


def load_dpo_job(path: str | None, overrides: list[str] | None = None) -> DPOJobConfig:
    return load_config(DPOJobConfig, resolve_config_path(path) if path else None, overrides)


def run_dpo_job(config: DPOJobConfig) -> dict:
    """Offline or iterative DPO, evaluated before and after; resumable like the PPO job (see run_job).

    Iterative checkpoints hold the round, the rounds so far, the task cycler and the round's pairs with their
    reference logprobs, so a resumed round trains on exactly the pairs it sampled."""
    import dataclasses
    import warnings
    from contextlib import nullcontext

    import torch

    from agentrl.checkpoint import Checkpointer, cached_eval, file_size, open_run, run_config, write_json, write_jsonl
    from agentrl.distributed import (end_processes, finish_trackers, gathered_for_generation, is_main_process,
                                     partial_state, sharded, world_banner)
    from agentrl.jobs.preferences import sample_pairs
    from agentrl.preferences import PreferenceExample, pair_to_example
    from agentrl.rollout.sampling import SamplingParams
    from agentrl.samples import SamplesLog
    from agentrl.trainers.common import TaskCycler
    from agentrl.trainers.dpo import DPOTrainer

    started = time.time()
    procs = partial_state()  # first: under torchrun without a GPU, the CPU process group (see agentrl.distributed)
    if procs.is_main_process:
        print(f"agentrl: {world_banner()}", flush=True)
    out = Path(config.out_dir)
    warn_ineffective(config, "dpo")
    if config.data is not None and config.iterative != IterativeSection():
        warnings.warn("config iterative.*: ignored when `data` is set (offline DPO)", UserWarning, stacklevel=2)
    if config.dpo.output_dir != DPOConfig().output_dir:
        warnings.warn(f"config dpo.output_dir: ignored; the job saves the adapter to {out / 'adapter'}", UserWarning,
                      stacklevel=2)
    fingerprint = run_config(to_dict(config))
    state = open_run(out, config.resume, fingerprint)
    # The iterative job's own state; `examples` are the current round's pairs while it trains.
    job = (state or {}).get("job") or {"config": fingerprint, "round": 0, "rounds": [], "record": None,
                                       "examples": None, "total_pairs": 0, "total_ties": 0, "steps": 0, "cycler": None}
    live: dict = {}  # the objects job_state() snapshots: the cycler and the examples being trained on

    def job_state() -> dict:
        snap = dict(job, config=fingerprint)
        if "cycler" in live:
            snap["cycler"] = live["cycler"].state_dict()
        if live.get("examples") is not None:
            snap["examples"] = [dataclasses.asdict(ex) for ex in live["examples"]]
        if "samples" in live:
            snap["samples_bytes"] = file_size(live["samples"].path)
        return snap

    checkpointer = Checkpointer(out / "checkpoints", config.checkpoint_every, config.keep_checkpoints,
                                config.max_nonfinite_steps, job_state=job_state)
    with checkpointer.signals():
        run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, config.progress)
        model, tokenizer, env_factory = run.model, run.tokenizer, run.env_factory
        max_new = config.rollout.max_new_tokens
        before = cached_eval(out, "before", fingerprint, lambda: run.evaluate_both(model, config.iterative.temperature))
        torch.manual_seed(config.dpo.seed)  # LoRA init and rollouts: the same run for the same config
        model = add_lora(model, config.model)
        dpo_cfg = replace(config.dpo, output_dir=str(out / "adapter"), progress=config.progress,
                          logging_dir=config.dpo.logging_dir or str(out))
        samples = live["samples"] = SamplesLog(out / "samples.jsonl", tokenizer, config.sample_every,
                                               config.samples_per_step if config.data is None and
                                               procs.is_main_process else 0,
                                               source="iterative-dpo",
                                               resume_bytes=job.get("samples_bytes") if state else None)
        trainer = None
        train_started = time.time()
        if config.data is not None:
            trainer = DPOTrainer(model=model, args=dpo_cfg, train_dataset=config.data, tokenizer=tokenizer)
            if state is not None:
                trainer.load_state_dict(state["trainer"])
                checkpointer.restore(state)
            with checkpointer.loop():
                trainer.train(metrics_path=str(out / "metrics.jsonl"), checkpointer=checkpointer)
            finish_trackers(trainer.accelerator)
            job["total_pairs"], job["steps"] = len(trainer.examples), trainer.total_steps
        else:
            cycler = live["cycler"] = TaskCycler(run.train_tasks(config.env, config.env.train_tasks,
                                                                 dpo_cfg.seed), dpo_cfg.seed)
            if job["cycler"] is not None:
                cycler.load_state_dict(job["cycler"])
            sampling = SamplingParams(max_new_tokens=max_new, temperature=config.iterative.temperature,
                                      top_k=config.rollout.top_k, top_p=config.rollout.top_p)
            for r in range(job["round"], config.iterative.rounds):
                resuming = job["examples"] is not None
                if resuming:  # killed inside this round: its pairs (and reference logprobs) are in the checkpoint
                    examples, record = [PreferenceExample(**ex) for ex in job["examples"]], job["record"]
                else:
                    model.eval()
                    # Several processes: each samples its share of the round's tasks; all get every pair.
                    # After a round under FSDP / ZeRO-3, with the parameters gathered.
                    with procs.split_between_processes(cycler.draw(config.iterative.tasks_per_round)) as mine, \
                            gathered_for_generation(trainer.accelerator, trainer.model) if trainer else nullcontext():
                        pairs, ties, rows = sample_pairs(model, tokenizer, env_factory, mine,
                                                         config.iterative.samples, sampling)
                    if procs.num_processes > 1:
                        from accelerate.utils import gather_object

                        pairs, rows = gather_object(pairs), gather_object(rows)
                        ties = sum(gather_object([ties]))
                    if procs.is_main_process:
                        write_jsonl(out / f"pairs-round{r}.jsonl", rows)
                    samples.write_pairs(r, pairs)
                    job["total_pairs"], job["total_ties"] = job["total_pairs"] + len(pairs), job["total_ties"] + ties
                    record = {"round": r, "pairs": len(pairs), "ties_skipped": ties,
                              "mean_chosen_score": sum(b.score for b, _ in pairs) / max(len(pairs), 1),
                              "mean_rejected_score": sum(w.score for _, w in pairs) / max(len(pairs), 1)}
                    examples = [pair_to_example(b, w) for b, w in pairs]
                if examples:
                    # Reference logprobs precomputed by the policy as it is now ("previous") or by the base.
                    round_cfg = replace(dpo_cfg, precompute_ref_log_probs=True,
                                        reference_with_adapter=config.iterative.reference == "previous")
                    # Under FSDP, the model as the last round wrapped it (its layers cannot be wrapped twice).
                    wrapped = trainer.model if trainer is not None and sharded(trainer.accelerator) else model
                    trainer = DPOTrainer(model=wrapped, args=round_cfg, tokenizer=tokenizer, train_dataset=examples)
                    job.update(round=r, record=record)
                    live["examples"] = trainer.examples
                    checkpointer.step_offset = job["steps"]
                    if resuming:
                        trainer.load_state_dict(state["trainer"])
                        checkpointer.restore(state)
                    else:  # the round's pairs, before any step on them
                        checkpointer.save(job["steps"], trainer.state_dict())
                    with checkpointer.loop():
                        history = trainer.train(metrics_path=str(out / f"metrics-round{r}.jsonl"),
                                                checkpointer=checkpointer)
                    finish_trackers(trainer.accelerator)
                    job["steps"] += trainer.total_steps
                    record.update({k: history[-1][k] for k in ("loss", "rewards/accuracies", "rewards/margins")})
                job["rounds"].append(record)
                job.update(round=r + 1, record=None, examples=None)
                live["examples"] = None
        train_seconds = time.time() - train_started
        adapter_dir = Path(dpo_cfg.output_dir)
        if trainer is None:
            raise RuntimeError("no preference pairs were produced in any round; nothing to train on")
        trainer.save_model(str(adapter_dir))
        after = cached_eval(out, "after", fingerprint, lambda: evaluate_trained(run, trainer, model,
                                                                                config.iterative.temperature))
    if not is_main_process():  # every process evaluated its share; the main one writes the summary
        end_processes()
        return None
    summary = {
        **held_out_summary(before, after),
        "algo": "dpo" if config.data else "iterative-dpo", "steps": job["steps"], "ppo_steps": 0,
        "rounds": job["rounds"], "pairs": job["total_pairs"], "ties_skipped": job["total_ties"],
        "eval_tasks": len(run.eval_tasks), "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - started, 1),
        "base_model_dir": str(run.base_dir), "adapter_dir": str(adapter_dir), "config": summary_config(config),
    }
    write_json(out / "summary.json", summary)
    end_processes()
    return summary


def evaluate_trained(run, trainer, model, temperature: float) -> dict:
    """run.evaluate_both on the trained `model`, on every process, with whole weights under FSDP / ZeRO-3."""
    from agentrl.distributed import gathered_for_generation

    with gathered_for_generation(trainer.accelerator, trainer.model):
        return run.evaluate_both(model, temperature)
