"""What `rollout.share_prefix` saves on a job's held-out evaluation: seconds, and whether the figures hold.

    python benchmarks/prefix_sharing.py --config real --model runs/real-sft/model [--tasks 200] [--rounds 1]

Evaluates the model on the config's held-out tasks (its env, seed, lengths and precision, one episode a task) the
way the jobs do (`jobs/evaluate.evaluate`: all tasks in one batch, the eval seed), greedy and sampled at T = 1, with the prompts' common prefix prefilled
once and without, alternating `--rounds` times. Prints the wall and CPU seconds, the shared prefix's length, the accuracies,
and how many greedy episodes wrote the same tokens both ways (the two differ only by float rounding).
"""

from __future__ import annotations

import argparse
import time

import torch

from agentrl.jobs.common import environment_factory, load_base, tasks_of
from agentrl.jobs.ppo import load_job
from agentrl.precision import resolve_mixed_precision
from agentrl.rollout.engine import encode_prompt, episode_metrics, rollout
from agentrl.rollout.sampling import SamplingParams, shared_prefix_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="real")
    parser.add_argument("--model", required=True, help="a model directory (or preset) to evaluate")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    job = load_job(args.config, ["out_dir=runs/prefix-sharing", f"env.eval_tasks={args.tasks}"])
    factory = environment_factory(job.env)
    tasks = tasks_of(job.env, job.env.eval_tasks, job.eval_seed, "eval")
    model, tokenizer = load_base(args.model, job.model)
    prompts = []
    for task in tasks:
        env = factory()
        if hasattr(env, "bind_tokenizer"):
            env.bind_tokenizer(tokenizer)
        prompts.append(encode_prompt(tokenizer, env.reset(task)))
    print(f"{len(tasks)} tasks, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{shared_prefix_length(prompts)} of them shared by all; torch threads {torch.get_num_threads()}", flush=True)
    bf16 = resolve_mixed_precision(job.ppo.mixed_precision, "cpu") == "bf16"
    greedy_episodes = {}
    for r in range(args.rounds):
        for share in (False, True):
            for greedy in (True, False):
                params = SamplingParams(max_new_tokens=job.rollout.max_new_tokens, temperature=1.0,
                                        do_sample=not greedy, share_prefix=share)
                started, cpu = time.perf_counter(), time.process_time()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    episodes = rollout(model.eval(), tokenizer, factory, tasks, params,
                                       generator=torch.Generator().manual_seed(job.eval_seed))
                seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
                metrics = episode_metrics(episodes)
                if greedy:
                    greedy_episodes[share] = episodes
                print(f"round {r + 1} share_prefix={share} {'greedy' if greedy else 'sampled'}: {seconds:.1f} s "
                      f"({cpu:.1f} CPU s), "
                      f"accuracy {metrics['env/accuracy']:.3f}, tool-call rate {metrics['env/tool_call_rate']:.3f}",
                      flush=True)
    same = sum(a.token_ids == b.token_ids for a, b in zip(greedy_episodes[False], greedy_episodes[True]))
    print(f"greedy episodes with the same tokens both ways: {same} of {len(tasks)}")


if __name__ == "__main__":
    main()
