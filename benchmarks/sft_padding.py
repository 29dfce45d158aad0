"""What `sft.group_by_length` saves on an SFT job's own batches: padded positions, and seconds a step.

    python benchmarks/sft_padding.py --config real [--steps 6] [--rounds 1] [override ...]

Builds the job's rows as `agentrl sft` does (the environment's demonstrations, and the replay rows when
`sft.replay_fraction` is set), then:
- over the job's `sft.steps` batches, the positions the model runs (batch x width) against the real tokens, with
  and without grouping (exact, no model run);
- `--steps` timed optimizer steps of each mode (after one untimed step), each mode from the same LoRA weights,
  alternating `--rounds` times. Everything else is the job's: LoRA, precision, learning rate, batch size.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace

import torch

from agentrl.jobs.common import add_lora, load_base, tasks_of
from agentrl.jobs.sft import demonstrations_of, load_sft_job, with_replay
from agentrl.trainers.sft import DemonstrationBatches, SFTTrainer


def positions(examples, sft, pad_id: int, grouped: bool) -> tuple[int, int]:
    batches = DemonstrationBatches(examples, sft.batch_size, pad_id, sft.seed, sft.shuffle, grouped)
    run = real = 0
    for _ in range(sft.steps):
        batch = batches.next()
        run, real = run + batch["input_ids"].numel(), real + int(batch["attention_mask"].sum())
    return run, real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="real")
    parser.add_argument("--steps", type=int, default=6, help="timed steps a mode and round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    config = load_sft_job(args.config, ["out_dir=runs/sft-padding", *args.overrides])
    eval_tasks = tasks_of(config.env, config.env.eval_tasks, config.eval_seed, "eval")
    data, name = demonstrations_of(config, eval_tasks)
    model, tokenizer = load_base(config.model.base, config.model)
    if config.sft.replay_fraction > 0:
        data, name = with_replay(data, name, config.sft, model, tokenizer, config.rollout.max_new_tokens)
    torch.manual_seed(config.sft.seed)
    policy = add_lora(model, config.model)
    start = copy.deepcopy({k: v for k, v in policy.state_dict().items() if "lora_" in k})

    sft = replace(config.sft, progress=False)
    examples = SFTTrainer(policy, sft, data, tokenizer, dataset_name=name).examples
    for grouped in (False, True):
        run, real = positions(examples, sft, tokenizer.pad_token_id, grouped)
        print(f"group_by_length={grouped}: {sft.steps} batches of {sft.batch_size}, {run} positions run for "
              f"{real} tokens ({run / real:.3f} a token)", flush=True)

    for r in range(args.rounds):
        for grouped in (False, True):
            policy.load_state_dict(start, strict=False)
            trainer = SFTTrainer(policy, replace(sft, steps=args.steps + 1, group_by_length=grouped,
                                                 warmup_steps=0), data, tokenizer, dataset_name=name)
            trainer.train(steps=1)  # untimed: the first step of a shape is slower
            started = time.perf_counter()
            trainer.train(steps=args.steps)
            seconds = (time.perf_counter() - started) / args.steps
            print(f"round {r + 1} group_by_length={grouped}: {seconds:.2f} s a step ({args.steps} steps, "
                  f"torch threads {torch.get_num_threads()})", flush=True)


if __name__ == "__main__":
    main()
