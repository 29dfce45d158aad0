"""What SFT's batching levers save on an SFT job's own batches: positions run, and seconds a step.

    python benchmarks/sft_padding.py --config real [--modes plain,share_prefix] [--steps 6] [--rounds 1] [override ...]

The modes: `plain` (neither lever), `group_by_length` (sft.group_by_length: batches of similar lengths) and
`share_prefix` (sft.share_prefix: the tokens a group of rows begins with run once a batch).

Builds the job's rows as `agentrl sft` does (the environment's demonstrations, and the replay rows when
`sft.replay_fraction` is set), then:
- over the job's `sft.steps` batches, the positions the model runs against the real tokens, in each mode (exact,
  no model run);
- the loss of the first batch in each mode from the same weights (the levers change no number beyond rounding);
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
from agentrl.trainers.common import TokenBatch, prefix_groups
from agentrl.trainers.sft import DemonstrationBatches, SFTTrainer, sft_loss

MODES = ("plain", "group_by_length", "share_prefix")


def positions(examples, sft, pad_id: int, mode: str) -> tuple[int, int]:
    """(positions the model runs, real tokens) over the job's sft.steps batches in `mode`."""
    batches = DemonstrationBatches(examples, sft.batch_size, pad_id, sft.seed, sft.shuffle, mode == "group_by_length")
    run = real = 0
    for _ in range(sft.steps):
        batch = batches.next()
        real += int(batch["attention_mask"].sum())
        if mode != "share_prefix":
            run += batch["input_ids"].numel()
            continue
        lengths = batch["attention_mask"].sum(-1)
        trained = (batch["labels"][:, 1:] != -100).float()
        alone = []
        for rows, prefix in prefix_groups(TokenBatch(batch["input_ids"], batch["attention_mask"], trained, trained)):
            if prefix < 2:
                alone.append(rows)
            else:  # the prefix once, then each row's rest padded to the group's longest
                run += prefix + len(rows) * int((lengths[rows] - prefix).max())
        if alone:
            rows = torch.cat(alone)
            run += len(rows) * int(lengths[rows].max())
    return run, real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="real")
    parser.add_argument("--modes", default="plain,share_prefix", help=f"comma-separated, of {', '.join(MODES)}")
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
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: {args.modes!r}; choose from {', '.join(MODES)}")
    for mode in modes:
        run, real = positions(examples, sft, tokenizer.pad_token_id, mode)
        print(f"{mode}: {sft.steps} batches of {sft.batch_size}, {run} positions run for {real} tokens "
              f"({run / real:.3f} a token)", flush=True)
    first = DemonstrationBatches(examples, sft.batch_size, tokenizer.pad_token_id, sft.seed, sft.shuffle).next()
    with torch.no_grad():
        policy.eval()  # no dropout: both modes see the same network
        for mode in modes:
            if mode != "group_by_length":  # another batch: nothing to compare
                print(f"{mode}: first batch's loss {sft_loss(policy, first, mode == 'share_prefix').item():.6f}")

    for r in range(args.rounds):
        for mode in modes:
            policy.load_state_dict(start, strict=False)
            trainer = SFTTrainer(policy, replace(sft, steps=args.steps + 1, group_by_length=mode == "group_by_length",
                                                 share_prefix=mode == "share_prefix", warmup_steps=0),
                                 data, tokenizer, dataset_name=name)
            trainer.train(steps=1)  # untimed: the first step of a shape is slower
            started = time.perf_counter()
            trainer.train(steps=args.steps)
            seconds = (time.perf_counter() - started) / args.steps
            print(f"round {r + 1} {mode}: {seconds:.2f} s a step ({args.steps} steps, torch threads "
                  f"{torch.get_num_threads()}, loss {trainer.history[-1]['loss']:.4f})", flush=True)


if __name__ == "__main__":
    main()
