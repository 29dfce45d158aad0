"""One PPO update on real rollouts, with the rests after the shared prompt in one padded forward or in two
groups by length (LogprobPaths.rest_min_saving), A/B in one process from the same weights.

    python benchmarks/ppo_rest_groups.py --config real model.base=runs/real-sft/model [other job overrides]

Rolls out `--batches` batches of the job's ppo.batch_size episodes with the job's own model, LoRA, environment and
sampling, then runs each batch's `_update` once per variant, alternating, each time from the same adapter, value
head and optimizer state and the same torch RNG, after one untimed warm-up update; the variants take turns going
first. Prints one JSON line: per variant the median wall and CPU seconds
of an update, the padded rest positions of each mini-batch forward, and the largest difference between the two
variants' loss and updated weights (rounding only, when the grouping is exact). Run it under OMP_NUM_THREADS=1
and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def rest_positions(batch, mini_batch_size: int, min_saving: float | None) -> tuple[int, int]:
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
        groups = length_groups(rest, min_saving) if min_saving is not None and len(rest) >= 4 else None
        groups = groups or [torch.arange(len(rest))]
        padded += sum(len(g) * int(rest[g].max()) for g in groups)
        real += int(rest.sum())
    return padded, real


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="real")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="job config overrides key=value")
    args = parser.parse_args()

    from agentrl.jobs.common import add_lora, prepare_run
    from agentrl.jobs.ppo import load_job, make_trainer
    from agentrl.rollout.engine import rollout
    from agentrl.trainers.common import LogprobPaths, check_batch, episodes_to_batch

    config = load_job(args.config, args.overrides)
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, False, config.sft)
    tasks = run.train_tasks(config.env, config.env.train_tasks, config.ppo.seed)
    torch.manual_seed(config.ppo.seed)
    trainer = make_trainer(config, add_lora(run.model, config.model), run.tokenizer, len(tasks), run.eval_tasks)
    from agentrl.jobs.common import rollout_sampling

    sampling = rollout_sampling(config.rollout, config.ppo.temperature)
    generator = torch.Generator().manual_seed(args.seed)
    batches, size = [], config.ppo.batch_size
    for b in range(args.batches):
        started = time.perf_counter()
        with trainer.accelerator.autocast():
            episodes = rollout(trainer.policy, run.tokenizer, run.env_factory, tasks[b * size:(b + 1) * size],
                               sampling, generator=generator, value_head=trainer._rollout_value_head)
        batch = episodes_to_batch(episodes, run.tokenizer.pad_token_id, config.ppo.missing_eos_penalty)
        check_batch(episodes, batch)
        batches.append(batch)
        print(f"batch {b}: rollout {time.perf_counter() - started:.1f} s, sampled tokens per episode "
              f"{[int(x) for x in batch.loss_mask.sum(-1)]}", flush=True)

    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    start_weights = [p.detach().clone() for p in trained]
    start_optim = copy.deepcopy(trainer.optimizer.state_dict())
    variants = {"one forward": None, "two groups": LogprobPaths.rest_min_saving}
    results = {name: {"wall": [], "cpu": [], "loss": [], "weights": []} for name in variants}
    trainer._update(batches[0])  # a warm-up (allocator, kernels), not timed; every update below starts afresh
    for b, batch in enumerate(batches):
        order = list(variants.items()) if b % 2 == 0 else list(variants.items())[::-1]
        for name, saving in order:
            with torch.no_grad():
                for p, w in zip(trained, start_weights):
                    p.copy_(w)
            trainer.optimizer.load_state_dict(start_optim)
            trainer.logprob_paths = LogprobPaths(rest_min_saving=2.0 if saving is None else saving)
            torch.manual_seed(args.seed + b)
            wall, cpu = time.perf_counter(), time.process_time()
            stats = trainer._update(batch)
            out = results[name]
            out["wall"].append(time.perf_counter() - wall)
            out["cpu"].append(time.process_time() - cpu)
            out["loss"].append(stats["ppo/loss/total"])
            out["weights"].append([p.detach().clone() for p in trained])
            print(f"batch {b} {name}: {out['wall'][-1]:.1f} s, loss {stats['ppo/loss/total']:.6f}", flush=True)
    one, two = results["one forward"], results["two groups"]
    report = {
        name: {"wall_s": round(statistics.median(r["wall"]), 2), "cpu_s": round(statistics.median(r["cpu"]), 2),
               "wall_each": [round(x, 2) for x in r["wall"]],
               "rest_positions_padded_real": [rest_positions(b, config.ppo.mini_batch_size, saving) for b in batches]}
        for name, (saving, r) in zip(variants, ((s, results[n]) for n, s in variants.items()))
    }
    report["max_loss_diff"] = max(abs(a - b) for a, b in zip(one["loss"], two["loss"]))
    report["max_weight_diff"] = max(float((a - b).abs().max()) for wa, wb in zip(one["weights"], two["weights"])
                                    for a, b in zip(wa, wb))
    report["max_weight_step"] = max(float((a - w).abs().max()) for wa in one["weights"]
                                    for a, w in zip(wa, start_weights))
    report["threads"] = torch.get_num_threads()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
