"""The peer's side of a peer benchmark: one task, in its own process, through TRL's documented API.

    .venv-peers/trl011/bin/python benchmarks/peers/trl_side.py --task ppo --model DIR --workload FILE
    .venv-peers/trl116/bin/python benchmarks/peers/trl_side.py --task grpo|dpo --model DIR --workload FILE

PPO is TRL 0.11.4's PPOTrainer (the generate/step loop of its examples; later TRLs have no such PPO), GRPO and
DPO are TRL 1.16's trainers, each given the settings in common.py. Prints one PEER-RESULT line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def lora_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **common.LORA)


def run_ppo(args, work, tok) -> dict:
    import torch
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    s = common.task_settings("ppo", work)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.model, peft_config=lora_config(),
                                                              torch_dtype=torch.float32)
    facts = common.model_facts(model.pretrained_model)
    config = PPOConfig(batch_size=s["batch_size"], mini_batch_size=s["mini_batch_size"], ppo_epochs=s["ppo_epochs"],
                       learning_rate=s["learning_rate"], seed=0,
                       accelerator_kwargs={"mixed_precision": args.precision, "cpu": True})
    trainer = PPOTrainer(config=config, model=model, ref_model=None, tokenizer=tok)
    before = common.trainable_snapshot(model)
    gen = {"max_new_tokens": s["response_tokens"], "do_sample": True,
           "top_k": 0, "top_p": 1.0, "batch_size": s["batch_size"], "pad_token_id": tok.pad_token_id}
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
                "response_tokens_mean": sum(lengths) / len(lengths),
                "precision": trainer.accelerator.mixed_precision}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, model), "flops_per_step": flops}


def timing_callback(clock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.tick()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


def common_args(args, out: str) -> dict:
    """TrainingArguments both TRL trainers get: fp32 unless --precision bf16 (as agentrl's side; bf16 on a CPU
    needs use_cpu), no checkpoints, no trackers, no gradient checkpointing (agentrl's side has none)."""
    return {"output_dir": out, "max_steps": args.warmup + args.steps, "logging_steps": 1, "report_to": "none",
            "save_strategy": "no", "bf16": args.precision == "bf16", "fp16": False, "use_cpu": True,
            "gradient_checkpointing": False, "dataloader_num_workers": 0, "seed": 0}


def run_grpo(args, work, tok) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    s = common.task_settings("grpo", work)

    def digit_reward(completions, **kwargs):
        return [common.digit_reward(c) for c in completions]

    clock = common.StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(**common_args(args, out), per_device_train_batch_size=s["prompts"] * s["num_generations"],
                            num_generations=s["num_generations"], max_completion_length=s["completion_tokens"],
                            beta=s["beta"],
                            num_iterations=s["num_iterations"], learning_rate=s["learning_rate"],
                            max_grad_norm=s["max_grad_norm"], temperature=1.0, top_k=0, top_p=1.0)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
        trainer = GRPOTrainer(model=model, reward_funcs=digit_reward, args=config, processing_class=tok,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in work["prompts"]]),
                              peft_config=lora_config(), callbacks=[timing_callback(clock)])
        facts = common.model_facts(trainer.model)
        before = common.trainable_snapshot(trainer.model)
        trainer.train()
        logs = [row for row in trainer.state.log_history if "completions/mean_length" in row]
    settings = {"prompts_per_step": config.per_device_train_batch_size // config.num_generations,
                "num_generations": config.num_generations, "mini_batch_size": config.per_device_train_batch_size,
                "num_iterations": config.num_iterations, "beta": config.beta, "learning_rate": config.learning_rate,
                "max_grad_norm": config.max_grad_norm, "temperature": config.temperature,
                "max_completion_tokens": config.max_completion_length,
                "precision": "bf16" if config.bf16 else "no",
                "completion_tokens_mean": sum(r["completions/mean_length"] for r in logs) / max(1, len(logs))}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, trainer.model)}


def run_dpo(args, work, tok) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    s = common.task_settings("dpo", work)
    clock = common.StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(**common_args(args, out), per_device_train_batch_size=s["batch_size"], beta=s["beta"],
                           learning_rate=s["learning_rate"], max_grad_norm=s["max_grad_norm"])
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
        trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(work["pairs"]),
                             processing_class=tok, peft_config=lora_config(), callbacks=[timing_callback(clock)])
        facts = common.model_facts(trainer.model)
        before = common.trainable_snapshot(trainer.model)
        trainer.train()
    settings = {"batch_size": config.per_device_train_batch_size, "beta": config.beta, "loss_type": config.loss_type,
                "learning_rate": config.learning_rate, "max_grad_norm": config.max_grad_norm,
                "optimizer": str(config.optim), "precompute_ref_log_probs": config.precompute_ref_log_probs,
                "pair_tokens_mean": work["pair_tokens_mean"], "precision": "bf16" if config.bf16 else "no"}
    return {"steps": clock.steps, "cpu_steps": clock.cpu_steps, "settings": settings, "model": facts,
            "moved": common.moved(before, trainer.model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(common.TASKS), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--count-flops", action="store_true", help="ppo: count one extra step's FLOPs")
    parser.add_argument("--precision", choices=("no", "bf16"), default="no", help="bf16: autocast (mixed precision)")
    args = parser.parse_args()
    common.one_thread()
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    wanted = "0.11" if args.task == "ppo" else "1.16"
    if not trl.__version__.startswith(wanted):
        sys.exit(f"{args.task} is measured against TRL {wanted}.x; this Python has TRL {trl.__version__}")
    if transformers.__version__.startswith("4."):
        # transformers 5 saves tokenizer_class "TokenizersBackend", which 4.x does not know; the files are the same.
        from transformers import PreTrainedTokenizerFast as AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    work = common.load_workload(args.workload)
    result = {"run_ppo": run_ppo, "run_grpo": run_grpo, "run_dpo": run_dpo}[f"run_{args.task}"](args, work, tok)
    result.update(side="peer", library=f"TRL {trl.__version__}", task=args.task, warmup=args.warmup,
                  versions={"torch": torch.__version__, "transformers": transformers.__version__},
                  threads=torch.get_num_threads())
    common.emit(result)


if __name__ == "__main__":
    main()
