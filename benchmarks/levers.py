"""Seconds per step of agentrl's PPO, GRPO and DPO at the issue #15 settings, to measure speed levers one by one.

    python benchmarks/levers.py --task ppo  [--steps 3] [--set reuse_rollout_logprobs=false] [--bf16]
    python benchmarks/levers.py --task grpo|dpo ...
    python benchmarks/levers.py --task rollout --model-dir runs/base-model [--no-kv-reuse]   # multi-turn
    python benchmarks/levers.py --task ppo-agent --model-dir runs/base-model [--no-bucketing]   # ragged episodes

The model is a randomly initialised Llama of 26 M parameters (hidden 512, 8 layers, 8 heads, MLP 1376) on the
embedded tokenizer, LoRA r 16 on q_proj/v_proj; it is built once (seeded) under --model-dir and reused, so every
process trains the same weights. Settings (issue #15): PPO 64 x (14 + 32) tokens, mini-batch 16, 4 epochs
(TRL 0.11's generate + step, timed apart); GRPO 8 prompts x 8, 32 new tokens, beta 0; DPO 16 pairs of
~56 tokens (14 prompt + two completions of 14-28). `--set key=value` overrides a trainer config field (the
levers' switches). Prints one JSON line: median wall and CPU s/step (and every step), peak RSS in MB, torch threads.
Run it under OMP_NUM_THREADS=1 (the issue's setting); interleave before/after runs on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time
from pathlib import Path

import torch


def build_model(model_dir: Path, tokenizer_dir: str, vocab: int | None = None) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (model_dir / "config.json").exists():
        return
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab or len(tok), hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=1376, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


def lora_model(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))


class Clock:
    """Wall and process CPU seconds of each timed step. On a shared machine the process's CPU time (one
    thread) is the steadier figure; the wall time is what a user waits on a machine of their own."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, keep: bool = True) -> None:
        if keep:
            self.wall.append(time.perf_counter() - self._wall)
            self.cpu.append(time.process_time() - self._cpu)


def parse_sets(sets: list[str]) -> dict:
    out = {}
    for item in sets:
        key, value = item.split("=", 1)
        out[key] = json.loads(value) if value not in ("true", "false") else value == "true"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=("ppo", "grpo", "dpo", "rollout", "ppo-agent"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model-dir", default="/work/scratch/issue15b/llama26m")
    parser.add_argument("--tokenizer", default="/work/scratch/issue15b/tok")
    parser.add_argument("--set", action="append", default=[], help="trainer config override key=value")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (mixed_precision / bf16)")
    parser.add_argument("--full-logits", action="store_true",
                        help="turn the response-only logprob path off (full (B, T, V) logits, as before)")
    parser.add_argument("--no-shared-prefix", action="store_true",
                        help="turn prompt sharing off (GRPO groups, DPO pairs run their prompt once per row)")
    parser.add_argument("--no-bucketing", action="store_true", help="one forward per mini-batch, however ragged")
    parser.add_argument("--no-kv-reuse", action="store_true", help="re-prefill every turn (rollout)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="a vocabulary this large (151936: Qwen's) instead of the tokenizer's 322; its own model dir")
    parser.add_argument("--pairs", type=int, default=256, help="DPO pairs (16 a step: 32 puts step 3 in epoch 2)")
    args = parser.parse_args()
    from agentrl.trainers.common import LogprobPaths

    paths = LogprobPaths(response_only=not args.full_logits, shared_prefix=not args.no_shared_prefix,
                         bucket_min_saving=2.0 if args.no_bucketing else LogprobPaths.bucket_min_saving)
    model_dir = Path(args.model_dir + (f"-v{args.vocab}" if args.vocab else ""))
    build_model(model_dir, args.tokenizer, args.vocab)

    from transformers import AutoTokenizer

    from agentrl.envs import CalculatorEnv, calculator_tasks
    from agentrl.rollout import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    overrides = parse_sets(args.set)
    tasks = calculator_tasks(64 * (args.steps + 2), seed=0)
    clock = Clock()
    extra: dict = {}
    if args.task == "ppo":
        from agentrl.trl_compat import PPOConfig, PPOTrainer

        cfg = PPOConfig(batch_size=64, mini_batch_size=16, ppo_epochs=4, learning_rate=1e-4,
                        mixed_precision="bf16" if args.bf16 else "no", **overrides)
        trainer = PPOTrainer(cfg, lora_model(model_dir), None, tok)
        trainer.logprob_paths = paths
        env = CalculatorEnv()
        gen_times = []
        for step in range(args.steps + 1):
            queries = [torch.tensor(tok(env.reset(t))["input_ids"]) for t in tasks[step * 64:(step + 1) * 64]]
            started = time.perf_counter()
            responses = trainer.generate(queries, return_prompt=False, max_new_tokens=32,
                                         batch_size=64)
            gen = time.perf_counter() - started
            scores = [float(len(set(r.tolist())) % 3 - 1) for r in responses]
            clock.start()
            stats = trainer.step(queries, responses, scores)
            clock.stop(keep=step > 0)  # the first step is a warm-up
            if step:
                gen_times.append(gen)
        extra = {"generate_s": statistics.median(gen_times), "kl": stats["objective/kl"],
                 "loss": stats["ppo/loss/total"],
                 "mismatch": stats.get("rollout/logprob_mismatch_mean")}
    elif args.task == "grpo":
        from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(tasks_per_step=8, num_generations=8, mini_batch_size=64, beta=0.0, learning_rate=1e-4,
                         mixed_precision="bf16" if args.bf16 else "no", **overrides)
        trainer = GRPOTrainer(cfg, lora_model(model_dir), tok)
        trainer.logprob_paths = paths
        sampling = SamplingParams(max_new_tokens=32, reuse_kv=not args.no_kv_reuse)
        single_turn = lambda: CalculatorEnv(max_turns=1)  # noqa: E731
        history = []
        for step in range(args.steps + 1):
            clock.start()
            history += trainer.train(single_turn, tasks, steps=1, sampling=sampling, progress=False)
            clock.stop(keep=step > 0)
        extra = {"rollout_s": statistics.median(h["time/rollout"] for h in history[1:]),
                 "update_s": statistics.median(h["time/update"] for h in history[1:]),
                 "mean_response_length": history[-1]["env/mean_response_length"]}
    elif args.task == "ppo-agent":  # the quickstart's PPO (agent loop, ragged multi-turn episodes)
        from agentrl.trl_compat import PPOConfig, PPOTrainer

        cfg = PPOConfig(batch_size=64, mini_batch_size=32, ppo_epochs=2, learning_rate=5e-4, adap_kl_ctrl=False,
                        init_kl_coef=0.05, **overrides)
        trainer = PPOTrainer(cfg, lora_model(model_dir), None, tok)
        trainer.logprob_paths = paths
        for step in range(args.steps + 1):
            clock.start()
            sampling = SamplingParams(max_new_tokens=48, reuse_kv=not args.no_kv_reuse)
            stats = trainer.train(CalculatorEnv, tasks, steps=1, sampling=sampling,
                                  progress=False)[-1]
            clock.stop(keep=step > 0)
        extra = {"update_s": stats["time/ppo/total"], "rollout_s": stats["time/rollout"],
                 "mean_turns": stats["env/mean_turns"]}
    elif args.task == "rollout":  # multi-turn episodes (a trained model calls the tool): 64 of CalculatorEnv
        from agentrl.rollout import rollout

        model = lora_model(model_dir).eval()
        for step in range(args.steps + 1):
            clock.start()
            sampling = SamplingParams(max_new_tokens=48, reuse_kv=not args.no_kv_reuse)
            episodes = rollout(model, tok, CalculatorEnv, tasks[step * 64:(step + 1) * 64], sampling,
                               generator=torch.Generator().manual_seed(step))
            clock.stop(keep=step > 0)
        extra = {"mean_turns": sum(ep.num_turns for ep in episodes) / len(episodes),
                 "tokens_per_episode": sum(len(ep.token_ids) for ep in episodes) / len(episodes)}
    else:
        from agentrl.preferences import PreferenceExample
        from agentrl.trainers.dpo import DPOConfig, DPOTrainer

        rng = random.Random(0)
        env = CalculatorEnv()
        vocab = list(range(3, len(tok)))
        examples = []
        for t in (tasks * 4)[:args.pairs]:
            prompt = tok(env.reset(t))["input_ids"]
            c, r = ([rng.choice(vocab) for _ in range(rng.randint(14, 28))] for _ in range(2))
            examples.append(PreferenceExample(prompt_ids=prompt, chosen_ids=c, chosen_mask=[1] * len(c),
                                              rejected_ids=r, rejected_mask=[1] * len(r)))
        cfg = DPOConfig(per_device_train_batch_size=16, max_steps=args.steps + 1, learning_rate=1e-4,
                        progress=False, bf16=args.bf16, logging_steps=1, **overrides)
        trainer = DPOTrainer(model=lora_model(model_dir), train_dataset=examples, tokenizer=tok, args=cfg)
        trainer.logprob_paths = paths
        for step in range(args.steps + 1):
            trainer.config.max_steps = step + 1
            clock.start()
            history = trainer.train()
            clock.stop(keep=step > 0)
        extra = {"loss": history[-1]["loss"]}
    print(json.dumps({"task": args.task, "set": overrides, "bf16": args.bf16, "threads": torch.get_num_threads(),
                      "s_per_step": round(statistics.median(clock.wall), 3),
                      "cpu_s_per_step": round(statistics.median(clock.cpu), 3), "wall": [round(t, 2) for t in clock.wall],
                      "cpu": [round(t, 2) for t in clock.cpu],
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in extra.items()}}))


if __name__ == "__main__":
    main()
