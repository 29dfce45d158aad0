"""Two levers for an agent's ragged batches (many short episodes, a few long), A/B in one process on the job's own
model, LoRA, environment and sampling: the rollout with and without rollout.compact (finished rows leave the
decoding batch), and one PPO update with the rests after the shared prompt in one padded forward or in groups by
length (LogprobPaths.rest_min_saving, rest_buckets).

    python benchmarks/ppo_ragged.py --buckets 1,2,3 model.base=runs/real-sft/model [other job overrides]

Rolls out `--batches` batches of ppo.batch_size episodes twice each, plain and compact, from the same generator
state (the order alternating), and counts the episodes that came out the same. Then it runs each plain batch's
`_update` once per variant, each time from the same adapter, value head and optimizer state and the same torch
RNG, after one untimed warm-up update (every other batch runs the variants in reverse order). Prints one JSON
line: the rollout seconds, and per variant the median wall and CPU seconds of an update, the padded rest positions
of the mini-batches in row order, and the largest difference from the first variant's loss and updated weights
(rounding only, when the grouping is exact). Run it under OMP_NUM_THREADS=1 and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace

import torch


def rest_positions(batch, mini_batch_size: int, paths) -> tuple[int, int]:
    """(padded positions of the rests after the common prefix, summed over mini-batches of the batch in order;
    the positions that are tokens): what the forwards of the optimisation pay, at one epoch."""
    from agentrl.trainers.common import length_groups

    padded = real = 0
    for start in range(0, len(batch), mini_batch_size):
        mb = batch.select(torch.arange(start, min(start + mini_batch_size, len(batch))))
        ids, mask = mb.input_ids, mb.loss_mask
        first = int((mask.float().argmax(-1) + 1).min())
        same = int((ids == ids[:1]).all(0).long().cumprod(0).sum())
        rest = mb.attention_mask.sum(-1) - min(same, first)
        groups = length_groups(rest, paths.rest_min_saving, paths.rest_buckets, best=True) if len(rest) >= 4 else None
        groups = groups or [torch.arange(len(rest))]
        padded += sum(len(g) * int(rest[g].max()) for g in groups)
        real += int(rest.sum())
    return padded, real


def decode_row_steps(episodes) -> tuple[int, int]:
    """(row-steps the sampler paid, row-steps that sampled a kept token), over every turn of a batch: a turn runs
    its live rows until the longest is done, so a row that stopped early is fed padding until then."""
    paid = used = 0
    turns: dict[int, list[int]] = {}
    for ep in episodes:
        runs, n = [], 0
        for m in ep.loss_mask + [0]:
            if m:
                n += 1
            elif n:
                runs, n = runs + [n], 0
        for t, length in enumerate(runs):
            turns.setdefault(t, []).append(length)
    for lengths in turns.values():
        paid += len(lengths) * max(lengths)
        used += sum(lengths)
    return paid, used


def job_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments these benchmarks share: the job config, batches, seed and key=value overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="real")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="job config overrides key=value")
    return parser


def job_trainer(config_name: str, overrides: list[str]):
    """(job config, prepared run, training tasks, PPO trainer with LoRA, rollout sampling) as the PPO job builds
    them, so a benchmark measures the job's own model, environment and settings."""
    from agentrl.jobs.common import add_lora, prepare_run, rollout_sampling
    from agentrl.jobs.ppo import load_job, make_trainer

    config = load_job(config_name, overrides)
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, False, config.sft)
    tasks = run.train_tasks(config.env, config.env.train_tasks, config.ppo.seed)
    torch.manual_seed(config.ppo.seed)
    trainer = make_trainer(config, add_lora(run.model, config.model), run.tokenizer, len(tasks), run.eval_tasks)
    return config, run, tasks, trainer, rollout_sampling(config.rollout, config.ppo.temperature)


def main() -> None:
    parser = job_arguments("rollout.compact and PPO's rest groups, A/B on the job's own batches")
    parser.add_argument("--buckets", default="1,3", help="the variants: at most this many groups of rests (1: one "
                        "forward), comma-separated")
    args = parser.parse_args()

    from agentrl.rollout.engine import rollout
    from agentrl.trainers.common import LogprobPaths, check_batch, episodes_to_batch

    config, run, tasks, trainer, sampling = job_trainer(args.config, args.overrides)
    generator = torch.Generator().manual_seed(args.seed)
    batches, decode, size = [], [], config.ppo.batch_size
    rollout_s: dict[str, list[float]] = {"plain": [], "compact": []}
    same = 0
    for b in range(args.batches):
        state, rolled = generator.get_state(), {}
        for compact in ((False, True) if b % 2 == 0 else (True, False)):
            generator.set_state(state)
            started = time.perf_counter()
            with trainer.accelerator.autocast():
                rolled[compact] = rollout(trainer.policy, run.tokenizer, run.env_factory,
                                          tasks[b * size:(b + 1) * size], replace(sampling, compact=compact),
                                          generator=generator, value_head=trainer._rollout_value_head)
            rollout_s["compact" if compact else "plain"].append(time.perf_counter() - started)
        episodes = rolled[False]
        same += sum(a.token_ids == c.token_ids for a, c in zip(episodes, rolled[True]))
        batch = episodes_to_batch(episodes, run.tokenizer.pad_token_id, config.ppo.missing_eos_penalty)
        check_batch(episodes, batch)
        batches.append(batch)
        decode.append(decode_row_steps(episodes))
        print(f"batch {b}: rollout plain {rollout_s['plain'][-1]:.1f} s, compact {rollout_s['compact'][-1]:.1f} s; "
              f"sampled tokens per episode {[int(x) for x in batch.loss_mask.sum(-1)]}, decode row-steps paid / "
              f"used {decode[-1]}", flush=True)

    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    start_weights = [p.detach().clone() for p in trained]
    start_optim = copy.deepcopy(trainer.optimizer.state_dict())
    variants = {f"{k} groups": LogprobPaths(rest_min_saving=2.0) if k == 1 else LogprobPaths(rest_buckets=k)
                for k in map(int, args.buckets.split(","))}
    results = {name: {"wall": [], "cpu": [], "loss": [], "weights": []} for name in variants}
    trainer._update(batches[0])  # a warm-up (allocator, kernels), not timed; every update below starts afresh
    for b, batch in enumerate(batches):
        order = list(variants.items()) if b % 2 == 0 else list(variants.items())[::-1]  # each goes first once
        for name, paths in order:
            with torch.no_grad():
                for p, w in zip(trained, start_weights):
                    p.copy_(w)
            trainer.optimizer.load_state_dict(start_optim)
            trainer.logprob_paths = paths
            torch.manual_seed(args.seed + b)
            wall, cpu = time.perf_counter(), time.process_time()
            stats = trainer._update(batch)
            out = results[name]
            out["wall"].append(time.perf_counter() - wall)
            out["cpu"].append(time.process_time() - cpu)
            out["loss"].append(stats["ppo/loss/total"])
            out["weights"].append([p.detach().clone() for p in trained])
            print(f"batch {b} {name}: {out['wall'][-1]:.1f} s, loss {stats['ppo/loss/total']:.6f}", flush=True)
    first = results[next(iter(variants))]
    report = {
        name: {"wall_s": round(statistics.median(r["wall"]), 2), "cpu_s": round(statistics.median(r["cpu"]), 2),
               "wall_each": [round(x, 2) for x in r["wall"]],
               "rest_positions_padded_real": [rest_positions(b, config.ppo.mini_batch_size, variants[name])
                                              for b in batches],
               # against the first variant: rounding only, when the grouping is exact
               "max_loss_diff": max(abs(a - b) for a, b in zip(first["loss"], r["loss"])),
               "max_weight_diff": max(float((a - b).abs().max()) for wa, wb in zip(first["weights"], r["weights"])
                                      for a, b in zip(wa, wb))}
        for name, r in results.items()
    }
    report["max_weight_step"] = max(float((a - w).abs().max()) for wa in first["weights"]
                                    for a, w in zip(wa, start_weights))
    report["decode_row_steps_paid_used"] = decode
    report["rollout_s"] = {k: [round(x, 2) for x in v] for k, v in rollout_s.items()}
    report["compact_same_episodes"] = f"{same} of {args.batches * size}"
    report["threads"] = torch.get_num_threads()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
