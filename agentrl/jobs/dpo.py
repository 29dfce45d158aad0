"""The DPO job behind `agentrl dpo` / `make demo-dpo`: offline DPO on a pairs file, or iterative DPO from
environment feedback: rounds of sample -> score -> pair -> DPO."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from agentrl.config import load_config, to_dict
from agentrl.judge import JudgeSection, check_judge, judge_hook
from agentrl.jobs.common import (EnvSection, ModelSection, RolloutSection, add_lora, eval_key, held_out_summary,
                                 prepare_run, resolve_config_path, rollout_sampling, stored_eval, summary_config,
                                 warn_ineffective)
from agentrl.trainers.dpo import DPOConfig


@dataclass
class IterativeSection:
    rounds: int = 3  # sample -> pair -> DPO rounds (ignored when `data` is set)
    tasks_per_round: int = 256  # tasks sampled per round
    samples: int = 4  # trajectories per task (K); chosen = best, rejected = worst, ties skipped
    reference: Literal["previous", "base"] = "previous"  # reference of each round: last round's policy or the base
    temperature: float = 1.0  # sampling temperature of the rollouts
    judge: JudgeSection = field(default_factory=JudgeSection)  # an LLM judge picks chosen/rejected instead of the
    # environment's score (agentrl/judge.py; ranking: one call per task's samples)


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


@dataclass
class _Job:
    """One DPO job's run: its config, out_dir, the checkpoint it resumed from, and `progress`, the iterative job's
    own state (round, rounds so far, pair counts, steps, the task cycler, the round's pairs while it trains),
    which every checkpoint holds beside the trainer's (snapshot)."""

    config: DPOJobConfig
    out: Path
    fingerprint: dict
    state: dict | None
    progress: dict
    live: dict = field(default_factory=dict)  # the objects snapshot() reads: cycler, examples being trained, samples
    checkpointer: object = None

    def snapshot(self) -> dict:
        import dataclasses

        from agentrl.checkpoint import file_size

        snap = dict(self.progress, config=self.fingerprint)
        if "cycler" in self.live:
            snap["cycler"] = self.live["cycler"].state_dict()
        if self.live.get("examples") is not None:
            snap["examples"] = [dataclasses.asdict(ex) for ex in self.live["examples"]]
        if "samples" in self.live:
            snap["samples_bytes"] = file_size(self.live["samples"].path)
        return snap


def run_dpo_job(config: DPOJobConfig) -> dict:
    """Offline or iterative DPO, evaluated before and after; resumable like the PPO job (see run_job).

    Iterative checkpoints hold the round, the rounds so far, the task cycler and the round's pairs with their
    reference logprobs, so a resumed round trains on exactly the pairs it sampled."""
    import torch

    from agentrl.checkpoint import write_json
    from agentrl.jobs.run import cached_eval, job_checkpointer, open_run, run_config
    from agentrl.distributed import end_processes, is_main_process, partial_state, world_banner
    from agentrl.samples import SamplesLog

    started = time.time()
    procs = partial_state()  # first: under torchrun without a GPU, the CPU process group (see agentrl.distributed)
    if procs.is_main_process:
        print(f"agentrl: {world_banner()}", flush=True)
    out = Path(config.out_dir)
    _warn_ignored(config, out)
    check_judge(config.iterative.judge, "iterative.judge")
    fingerprint = run_config(to_dict(config))
    state = open_run(out, config.resume, fingerprint)
    job = _Job(config, out, fingerprint, state, (state or {}).get("job") or {
        "config": fingerprint, "round": 0, "rounds": [], "record": None, "examples": None, "total_pairs": 0,
        "total_ties": 0, "steps": 0, "cycler": None})
    job.checkpointer = job_checkpointer(out, config, job_state=job.snapshot)
    with job.checkpointer.signals():
        run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, config.progress)
        precision = "bf16" if config.dpo.bf16 else "fp16" if config.dpo.fp16 else "no"
        key = eval_key(config.env, config.eval_seed, config.rollout, config.iterative.temperature, precision)
        before = cached_eval(out, "before", fingerprint, lambda: stored_eval(run.base_dir, key) or run.evaluate_both(
            run.model, config.iterative.temperature, precision))
        torch.manual_seed(config.dpo.seed)  # LoRA init and rollouts: the same run for the same config
        model = add_lora(run.model, config.model)
        dpo_cfg = replace(config.dpo, output_dir=str(out / "adapter"), progress=config.progress,
                          logging_dir=config.dpo.logging_dir or str(out))
        job.live["samples"] = SamplesLog(out / "samples.jsonl", run.tokenizer, config.sample_every,
                                         config.samples_per_step if config.data is None and procs.is_main_process
                                         else 0, source="iterative-dpo",
                                         resume_bytes=job.progress.get("samples_bytes") if state else None)
        train_started = time.time()
        trainer = (_offline_dpo(job, dpo_cfg, model, run.tokenizer) if config.data is not None
                   else _iterative_dpo(job, dpo_cfg, run, model, procs))
        train_seconds = time.time() - train_started
        if trainer is None:
            raise RuntimeError("no preference pairs were produced in any round; nothing to train on")
        trainer.save_model(dpo_cfg.output_dir)
        after = cached_eval(out, "after", fingerprint, lambda: evaluate_trained(run, trainer, model,
                                                                                config.iterative.temperature))
    if not is_main_process():  # every process evaluated its share; the main one writes the summary
        end_processes()
        return None
    progress = job.progress
    summary = {
        **held_out_summary(before, after),
        "algo": "dpo" if config.data else "iterative-dpo", "steps": progress["steps"], "ppo_steps": 0,
        "rounds": progress["rounds"], "pairs": progress["total_pairs"], "ties_skipped": progress["total_ties"],
        "eval_tasks": len(run.eval_tasks), "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - started, 1),
        "base_model_dir": str(run.base_dir), "adapter_dir": dpo_cfg.output_dir, "config": summary_config(config),
        **({"judge": job.live["judge"].summary()} if job.live.get("judge") else {}),
    }
    write_json(out / "summary.json", summary)
    end_processes()
    return summary


def _warn_ignored(config: DPOJobConfig, out: Path) -> None:
    import warnings

    warn_ineffective(config, "dpo")
    if config.data is not None and config.iterative != IterativeSection():
        warnings.warn("config iterative.*: ignored when `data` is set (offline DPO)", UserWarning, stacklevel=3)
    if config.dpo.output_dir != DPOConfig().output_dir:
        warnings.warn(f"config dpo.output_dir: ignored; the job saves the adapter to {out / 'adapter'}", UserWarning,
                      stacklevel=3)


def _offline_dpo(job: _Job, dpo_cfg: DPOConfig, model, tokenizer):
    """DPO on the pairs of `config.data`; the trainer."""
    from agentrl.distributed import finish_trackers
    from agentrl.trainers.dpo import DPOTrainer

    trainer = DPOTrainer(model=model, args=dpo_cfg, train_dataset=job.config.data, tokenizer=tokenizer)
    if job.state is not None:
        trainer.load_state_dict(job.state["trainer"])
        job.checkpointer.restore(job.state)
    with job.checkpointer.loop():
        trainer.train(metrics_path=str(job.out / "metrics.jsonl"), checkpointer=job.checkpointer)
    finish_trackers(trainer.accelerator)
    job.progress["total_pairs"], job.progress["steps"] = len(trainer.examples), trainer.total_steps
    return trainer


def _iterative_dpo(job: _Job, dpo_cfg: DPOConfig, run, model, procs):
    """Rounds of sample -> score -> pair -> DPO from the round's policy; the last round's trainer (None if no
    round produced a pair)."""
    from agentrl.preferences import PreferenceExample
    from agentrl.trainers.common import TaskCycler

    config, progress = job.config, job.progress
    cycler = job.live["cycler"] = TaskCycler(run.train_tasks(config.env, config.env.train_tasks, dpo_cfg.seed),
                                             dpo_cfg.seed)
    if progress["cycler"] is not None:
        cycler.load_state_dict(progress["cycler"])
    sampling = rollout_sampling(config.rollout, config.iterative.temperature)
    job.live["judge"] = judge_hook(config.iterative.judge, run.tokenizer, job.out)  # cached in out/judge-cache.jsonl
    trainer = None
    for r in range(progress["round"], config.iterative.rounds):
        resuming = progress["examples"] is not None
        if resuming:  # killed inside this round: its pairs (and reference logprobs) are in the checkpoint
            examples, record = [PreferenceExample(**ex) for ex in progress["examples"]], progress["record"]
        else:
            examples, record = _sample_round(job, r, run, model, trainer, cycler, sampling, procs)
        if examples:
            trainer = _train_round(job, r, dpo_cfg, model, run.tokenizer, trainer, examples, record, resuming)
        progress["rounds"].append(record)
        progress.update(round=r + 1, record=None, examples=None)
        job.live["examples"] = None
    return trainer


def _sample_round(job: _Job, r: int, run, model, trainer, cycler, sampling, procs) -> tuple[list, dict]:
    """Round r's pairs (best vs worst of `samples` trajectories per task), written to pairs-round{r}.jsonl and the
    samples log; (the preference examples, the round's record)."""
    from contextlib import nullcontext

    from agentrl.checkpoint import write_jsonl
    from agentrl.distributed import gathered_for_generation
    from agentrl.jobs.preferences import sample_pairs
    from agentrl.preferences import pair_to_example

    config, progress = job.config, job.progress
    model.eval()
    # Several processes: each samples its share of the round's tasks; all get every pair.
    # After a round under FSDP / ZeRO-3, with the parameters gathered.
    with procs.split_between_processes(cycler.draw(config.iterative.tasks_per_round)) as mine, \
            gathered_for_generation(trainer.accelerator, trainer.model) if trainer else nullcontext():
        pairs, ties, rows = sample_pairs(model, run.tokenizer, run.env_factory, mine, config.iterative.samples,
                                         sampling, job.live.get("judge"))
    if procs.num_processes > 1:
        from accelerate.utils import gather_object

        pairs, rows = gather_object(pairs), gather_object(rows)
        ties = sum(gather_object([ties]))
    if procs.is_main_process:
        write_jsonl(job.out / f"pairs-round{r}.jsonl", rows)
    job.live["samples"].write_pairs(r, pairs)
    progress["total_pairs"] += len(pairs)
    progress["total_ties"] += ties
    record = {"round": r, "pairs": len(pairs), "ties_skipped": ties,
              "mean_chosen_score": sum(b.score for b, _ in pairs) / max(len(pairs), 1),
              "mean_rejected_score": sum(w.score for _, w in pairs) / max(len(pairs), 1)}
    return [pair_to_example(b, w) for b, w in pairs], record


def _train_round(job: _Job, r: int, dpo_cfg: DPOConfig, model, tokenizer, trainer, examples, record: dict,
                 resuming: bool):
    """DPO on round r's pairs (a checkpoint first, so a killed round resumes on the same pairs); the trainer."""
    from agentrl.distributed import finish_trackers, sharded
    from agentrl.trainers.dpo import DPOTrainer

    progress, checkpointer = job.progress, job.checkpointer
    # Reference logprobs precomputed by the policy as it is now ("previous") or by the base.
    round_cfg = replace(dpo_cfg, precompute_ref_log_probs=True,
                        reference_with_adapter=job.config.iterative.reference == "previous")
    # Under FSDP, the model as the last round wrapped it (its layers cannot be wrapped twice).
    wrapped = trainer.model if trainer is not None and sharded(trainer.accelerator) else model
    trainer = DPOTrainer(model=wrapped, args=round_cfg, tokenizer=tokenizer, train_dataset=examples)
    progress.update(round=r, record=record)
    job.live["examples"] = trainer.examples
    checkpointer.step_offset = progress["steps"]
    if resuming:
        trainer.load_state_dict(job.state["trainer"])
        checkpointer.restore(job.state)
    else:  # the round's pairs, before any step on them
        checkpointer.save(progress["steps"], trainer.state_dict())
    with checkpointer.loop():
        history = trainer.train(metrics_path=str(job.out / f"metrics-round{r}.jsonl"), checkpointer=checkpointer)
    finish_trackers(trainer.accelerator)
    progress["steps"] += trainer.total_steps
    record.update({k: history[-1][k] for k in ("loss", "rewards/accuracies", "rewards/margins")})
    return trainer


def evaluate_trained(run, trainer, model, temperature: float) -> dict:
    """run.evaluate_both on the trained `model`, on every process, with whole weights under FSDP / ZeRO-3, at the
    precision it trained at."""
    from agentrl.distributed import gathered_for_generation

    with gathered_for_generation(trainer.accelerator, trainer.model):
        return run.evaluate_both(model, temperature, trainer.accelerator.mixed_precision)
