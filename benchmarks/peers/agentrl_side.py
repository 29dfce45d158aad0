"""agentrl's side of a peer benchmark: one task, in its own process, through agentrl's public API.

    python benchmarks/peers/agentrl_side.py --task ppo --model DIR --workload FILE [--warmup 1 --steps 3]

Written as a user would: the classic PPOTrainer.generate/.step loop for PPO (what a TRL 0.11 script does),
GRPOTrainer.train over a one-turn environment for GRPO, DPOTrainer.train for DPO. Prints one PEER-RESULT line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def lora_model(path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **common.LORA))


def with_levers(trainer, args):
    """The trainer with the logprob shortcuts that --full-logits / --no-shared-prefix switch off (to measure them)."""
    from agentrl.trainers.common import LogprobPaths

    trainer.logprob_paths = LogprobPaths(response_only=not args.full_logits, shared_prefix=not args.no_shared_prefix)
    return trainer


def run_ppo(args, work, tok) -> dict:
    import torch

    from agentrl import PPOConfig, PPOTrainer

    s = common.task_settings("ppo", work)
    model = lora_model(args.model)
    facts = common.model_facts(model)
    config = PPOConfig(batch_size=s["batch_size"], mini_batch_size=s["mini_batch_size"], ppo_epochs=s["ppo_epochs"],
                       learning_rate=s["learning_rate"], seed=0, mixed_precision=args.precision)
    trainer = with_levers(PPOTrainer(config=config, model=model, tokenizer=tok), args)
    before = common.trainable_snapshot(model)
    gen = {"max_new_tokens": s["response_tokens"], "do_sample": True,
           "top_k": 0, "top_p": 1.0, "batch_size": s["batch_size"]}
    clock, lengths = common.StepClock(), []
    queries_all = work["ppo_query_ids"]

    def one_step(i: int) -> None:
        start = i * s["batch_size"] % len(queries_all)
        queries = [torch.tensor(q) for q in queries_all[start:start + s["batch_size"]]]
        responses = trainer.generate(queries, return_prompt=False, **gen)
        scores = [torch.tensor(common.digit_reward(tok.decode(r, skip_special_tokens=True))) for r in responses]
        trainer.step(queries, responses, scores)
        lengths.extend(len(r) for r in responses)

    flops = common.step_loop(args, one_step, clock)
    settings = {"batch_size": config.batch_size, "mini_batch_size": config.mini_batch_size,
                "ppo_epochs": config.ppo_epochs, "learning_rate": config.learning_rate,
                "query_tokens": [min(map(len, queries_all)), max(map(len, queries_all))], "generate": gen,
                "response_tokens_mean": sum(lengths) / len(lengths), "precision": config.mixed_precision}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, model), "flops_per_step": flops}


class OneTurnEnv:
    """The GRPO workload as an agentrl environment: the prompt is the task, one completion, scored by digit_reward."""

    stop_patterns: tuple = ()
    max_turns = 1

    def reset(self, task: dict) -> str:
        return task["prompt"]

    def step(self, action: str):
        from agentrl.envs import StepResult

        return StepResult(observation=None, reward=common.digit_reward(action), done=True, info={})


def run_grpo(args, work, tok) -> dict:
    from agentrl import GRPOConfig, GRPOTrainer
    from agentrl.rollout import SamplingParams

    s = common.task_settings("grpo", work)
    model = lora_model(args.model)
    facts = common.model_facts(model)
    config = GRPOConfig(tasks_per_step=s["prompts"], num_generations=s["num_generations"],
                        mini_batch_size=s["mini_batch_size"], num_iterations=s["num_iterations"], beta=s["beta"],
                        learning_rate=s["learning_rate"], max_grad_norm=s["max_grad_norm"], seed=0,
                        mixed_precision=args.precision)
    trainer = with_levers(GRPOTrainer(config, model, tok), args)
    sampling = SamplingParams(max_new_tokens=s["completion_tokens"])
    before = common.trainable_snapshot(model)
    clock = common.StepClock()
    clock.tick()
    history = trainer.train(OneTurnEnv, [{"prompt": p} for p in work["prompts"]], steps=args.warmup + args.steps,
                            sampling=sampling, progress=False, callback=lambda step, stats: clock.tick())
    settings = {"prompts_per_step": config.tasks_per_step, "num_generations": config.num_generations,
                "mini_batch_size": config.mini_batch_size, "num_iterations": config.num_iterations,
                "beta": config.beta, "learning_rate": config.learning_rate, "max_grad_norm": config.max_grad_norm,
                "max_completion_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "precision": config.mixed_precision,
                "completion_tokens_mean": sum(h["env/mean_response_length"] for h in history) / len(history)}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, model)}


def run_dpo(args, work, tok) -> dict:
    from agentrl import DPOConfig, DPOTrainer

    s = common.task_settings("dpo", work)
    model = lora_model(args.model)
    facts = common.model_facts(model)
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(output_dir=out, per_device_train_batch_size=s["batch_size"], learning_rate=s["learning_rate"],
                           beta=s["beta"], max_grad_norm=s["max_grad_norm"], max_steps=args.warmup + args.steps,
                           logging_steps=1, progress=False, bf16=args.precision == "bf16")
        trainer = DPOTrainer(model=model, args=config, train_dataset=work["pairs"], tokenizer=tok)
        trainer = with_levers(trainer, args)
        before = common.trainable_snapshot(model)
        clock = common.StepClock()

        class StepHook:  # train()'s checkpointer hook runs after every step; here it only reads the clock
            def after_step(self, trainer, step, stats, last=False):
                clock.tick()

        clock.tick()
        trainer.train(checkpointer=StepHook())
    settings = {"batch_size": config.per_device_train_batch_size, "beta": config.beta, "loss_type": config.loss_type,
                "learning_rate": config.learning_rate, "max_grad_norm": config.max_grad_norm,
                "optimizer": "AdamW", "precompute_ref_log_probs": config.precompute_ref_log_probs,
                "pair_tokens_mean": work["pair_tokens_mean"], "precision": "bf16" if config.bf16 else "no"}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(common.TASKS), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--count-flops", action="store_true", help="ppo: count one extra step's FLOPs")
    parser.add_argument("--precision", choices=("no", "bf16"), default="no", help="bf16: autocast (mixed precision)")
    parser.add_argument("--full-logits", action="store_true", help="a lever off: full (B, T, V) logits "
                        "(trainers/common.LogprobPaths.response_only)")
    parser.add_argument("--no-shared-prefix", action="store_true", help="a lever off: each row runs its own prompt "
                        "(LogprobPaths.shared_prefix: GRPO groups, DPO pairs)")
    args = parser.parse_args()
    common.one_thread()
    import agentrl
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    work = common.load_workload(args.workload)
    result = {"run_ppo": run_ppo, "run_grpo": run_grpo, "run_dpo": run_dpo}[f"run_{args.task}"](args, work, tok)
    result.update(levers={"response_only": not args.full_logits, "shared_prefix": not args.no_shared_prefix})
    result.update(side="agentrl", library=f"agentrl {agentrl.__version__}", task=args.task, warmup=args.warmup,
                  versions={"torch": torch.__version__, "transformers": transformers.__version__},
                  threads=torch.get_num_threads())
    common.emit(result)


if __name__ == "__main__":
    main()
