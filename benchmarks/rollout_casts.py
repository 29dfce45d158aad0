"""Rollouts under bf16 autocast with and without the frozen weights' casts cached (precision.frozen_casts_cached),
A/B in one process on the job's own model, LoRA, environment and sampling.

    python benchmarks/rollout_casts.py model.base=runs/real-sft/model [other job overrides]

Autocast caches its float32 -> bf16 casts only for parameters that require grad; under LoRA the frozen backbone is
cast again at every decoding step unless the rollout marks it (what `rollout` does). Here "cast per call" runs the
rollout under an autocast whose cache is off (so the LoRA weights, about 1% of the parameters, are re-cast too),
"cast once" under the trainers' autocast. Each batch of ppo.batch_size tasks is rolled out both ways from the same
generator state, in alternating order, after one untimed warm-up rollout. Prints one JSON line: the seconds per
rollout for each way, and whether every episode's tokens and sampler logprobs came out identical. Needs a CPU with
native bf16 (elsewhere autocast emulates bf16 and the figures say nothing). Run it with nothing else on the machine.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from ppo_ragged import job_arguments, job_trainer  # this folder: scripts run as `python benchmarks/...`


def main() -> None:
    args = job_arguments("rollouts with the frozen weights cast per call or once, A/B").parse_args()

    from agentrl.rollout.engine import rollout

    config, run, tasks, trainer, sampling = job_trainer(args.config, args.overrides)
    size = config.ppo.batch_size
    generator = torch.Generator().manual_seed(args.seed)

    def roll(batch_tasks, cache: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            return rollout(trainer.policy, run.tokenizer, run.env_factory, batch_tasks, sampling, generator=generator,
                           value_head=trainer._rollout_value_head)

    roll(tasks[:size], True)  # warm-up: allocator, kernels
    seconds: dict[str, list[float]] = {"cast per call": [], "cast once": []}
    same = tokens = 0
    for b in range(args.batches):
        state, rolled = generator.get_state(), {}
        for cache in ((False, True) if b % 2 == 0 else (True, False)):
            generator.set_state(state)
            started = time.perf_counter()
            rolled[cache] = roll(tasks[(b + 1) * size:(b + 2) * size], cache)
            seconds["cast once" if cache else "cast per call"].append(time.perf_counter() - started)
        same += sum(a.token_ids == c.token_ids and a.logprobs == c.logprobs
                    for a, c in zip(rolled[False], rolled[True]))
        tokens += sum(sum(e.loss_mask) for e in rolled[True])
        print(f"batch {b}: cast per call {seconds['cast per call'][-1]:.1f} s, cast once "
              f"{seconds['cast once'][-1]:.1f} s", flush=True)
    print(json.dumps({
        **{k: {"median_s": round(statistics.median(v), 2), "each_s": [round(x, 2) for x in v]}
           for k, v in seconds.items()},
        "identical_episodes": f"{same} of {args.batches * size}", "sampled_tokens": tokens,
        "threads": torch.get_num_threads(), "bf16_native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}))


if __name__ == "__main__":
    main()
