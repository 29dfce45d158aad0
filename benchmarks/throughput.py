"""Rollout and training throughput on the embedded model (CPU here; pass --device cuda on a GPU).

    python benchmarks/throughput.py --model runs/base-model [--device cuda] [--dtype bfloat16]

Prints one JSON line: rollout episodes/s and sampled tokens/s, PPO/GRPO/DPO seconds per step.
"""

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="runs/base-model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs import CalculatorEnv, calculator_tasks
    from agentrl.preferences import build_pairs, pair_to_example
    from agentrl.rollout import SamplingParams, rollout
    from agentrl.trainers.dpo import DPOConfig, DPOTrainer
    from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer
    from agentrl.trl_compat import PPOConfig, PPOTrainer

    tok = AutoTokenizer.from_pretrained(args.model)

    def lora():
        m = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
        return get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))

    tasks = calculator_tasks(args.batch * (args.steps + 1), seed=0)
    sampling = SamplingParams(max_new_tokens=48)
    model = lora().eval()
    rollout(model, tok, CalculatorEnv, tasks[: args.batch], sampling)  # warm-up
    started = time.time()
    episodes = rollout(model, tok, CalculatorEnv, tasks[: args.batch * args.steps], sampling, batch_size=args.batch)
    seconds = time.time() - started
    out = {"device": args.device, "dtype": args.dtype, "rollout_episodes_per_s": len(episodes) / seconds,
           "rollout_sampled_tokens_per_s": sum(sum(e.loss_mask) for e in episodes) / seconds}

    def per_step(trainer, **kw):
        trainer.train(CalculatorEnv, tasks, steps=1, sampling=sampling, progress=False, **kw)  # warm-up
        started = time.time()
        trainer.train(CalculatorEnv, tasks, steps=args.steps, sampling=sampling, progress=False, **kw)
        return (time.time() - started) / args.steps

    mixed = "bf16" if args.dtype == "bfloat16" else "no"
    out["ppo_s_per_step"] = per_step(PPOTrainer(PPOConfig(batch_size=args.batch, mini_batch_size=args.batch // 2,
                                                          ppo_epochs=2, mixed_precision=mixed), lora(), None, tok))
    out["grpo_s_per_step"] = per_step(GRPOTrainer(GRPOConfig(tasks_per_step=args.batch // 8, num_generations=8,
                                                             mini_batch_size=args.batch // 2, mixed_precision=mixed),
                                                  lora(), tok))
    pairs, _ = build_pairs(rollout(model, tok, CalculatorEnv, [t for t in tasks[:64] for _ in range(4)], sampling), 4)
    dpo = DPOTrainer(model=lora(), train_dataset=[pair_to_example(b, w) for b, w in pairs], tokenizer=tok,
                     args=DPOConfig(per_device_train_batch_size=16, max_steps=args.steps, progress=False,
                                    bf16=args.dtype == "bfloat16"))
    started = time.time()
    dpo.train()
    out["dpo_s_per_step_16_pairs"] = (time.time() - started) / args.steps
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
