"""One SFT step (forward and backward of the loss) on the real-model SFT job's own batches, with the rests after
each shared prefix in one padded forward or in groups by length (LogprobPaths.rest_buckets), A/B in one process.

    python benchmarks/sft_ragged.py --buckets 1,3 [SFT job overrides, e.g. env.* of another environment]

Encodes the job's demonstrations (without sft.replay_fraction's rows, which need the model to answer first) and
draws `--batches` batches of sft.batch_size as the job does. Each batch runs once per variant, the order reversed
on every other batch, after one untimed warm-up; gradients are compared with the first variant's. Prints one JSON
line: per variant the median wall and CPU seconds a step and the largest loss and gradient difference. Run it
under OMP_NUM_THREADS=1 with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="real")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--buckets", default="1,3", help="variants: at most this many groups of rests (1: one forward)")
    parser.add_argument("overrides", nargs="*", help="SFT job config overrides key=value")
    args = parser.parse_args()

    from agentrl.jobs.common import add_lora, load_base, tasks_of
    from agentrl.jobs.sft import demonstrations_of, load_sft_job
    from agentrl.precision import resolve_mixed_precision
    from agentrl.trainers.common import LogprobPaths
    from agentrl.trainers.sft import DemonstrationBatches, SFTTrainer, shared_prefix_loss

    config = load_sft_job(args.config, args.overrides)
    data, _ = demonstrations_of(config, tasks_of(config.env, config.env.eval_tasks, config.eval_seed, "eval"))
    model, tokenizer = load_base(config.model.base, config.model)
    sft = replace(config.sft, progress=False)
    torch.manual_seed(sft.seed)
    trainer = SFTTrainer(add_lora(model, config.model), sft, data, tokenizer)
    model = trainer.model.train()
    batches = DemonstrationBatches(trainer.examples, sft.batch_size, tokenizer.pad_token_id, sft.seed, sft.shuffle,
                                   sft.group_by_length)
    batches = [batches.next() for _ in range(args.batches)]
    bf16 = resolve_mixed_precision(sft.mixed_precision, "cpu") == "bf16"
    params = [p for p in model.parameters() if p.requires_grad]
    variants = {f"{k} groups": LogprobPaths(rest_min_saving=2.0) if k == 1 else LogprobPaths(rest_buckets=k)
                for k in map(int, args.buckets.split(","))}

    def step(batch, paths):
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = shared_prefix_loss(model, batch, paths)
        loss.backward()
        return time.perf_counter() - wall, time.process_time() - cpu, loss.item(), [p.grad.clone() for p in params]

    step(batches[0], next(iter(variants.values())))  # warm-up
    results = {name: {"wall": [], "cpu": [], "loss": [], "grads": []} for name in variants}
    for b, batch in enumerate(batches):
        order = list(variants.items()) if b % 2 == 0 else list(variants.items())[::-1]
        for name, paths in order:
            wall, cpu, loss, grads = step(batch, paths)
            for key, value in zip(("wall", "cpu", "loss", "grads"), (wall, cpu, loss, grads)):
                results[name][key].append(value)
            print(f"batch {b} {name}: {wall:.1f} s, loss {loss:.6f}", flush=True)
    first = results[next(iter(variants))]
    report = {name: {"wall_s": round(statistics.median(r["wall"]), 2), "cpu_s": round(statistics.median(r["cpu"]), 2),
                     "wall_each": [round(x, 2) for x in r["wall"]],
                     "max_loss_diff": max(abs(a - b) for a, b in zip(first["loss"], r["loss"])),
                     "max_grad_diff": max(float((a - b).abs().max()) for ga, gb in zip(first["grads"], r["grads"])
                                          for a, b in zip(ga, gb))}
              for name, r in results.items()}
    report["max_grad"] = max(float(g.abs().max()) for gs in first["grads"] for g in gs)
    report["threads"], report["bf16"] = torch.get_num_threads(), bf16
    print(json.dumps(report))


if __name__ == "__main__":
    main()
