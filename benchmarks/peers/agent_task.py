"""The agent task the peers were never measured on: GRPO on a calculator agent that makes real tool calls.

    python benchmarks/peers/agent_task.py [--steps 40] [--target 0.7] [--json runs/agent-task.json]
    python benchmarks/peers/agent_task.py --model smollm2-135m [--steps 16] [--target 0.6]   # the real model

The real-model mode (SmolLM2-135M-Instruct after `agentrl sft --config real`, agentrl GRPO and PPO against TRL
1.16 GRPO with tools) is in agent_real.py, which says what differs; the rest of this text is the embedded model's.

The embedded chat model (ChatML, Hermes `<tool_call>{json}</tool_call>` calls, `agentrl base-model corpus=chat
steps=1000`) answers held-out "What is a op b?" questions and may call `calculator(expression)`, which really runs
(agentrl.envs.calculator: a safe AST evaluator). Both sides run GRPO with the same model, tool function, rewards
(1.0 correct after a call, 0.2 call but wrong, -0.5 only failed calls, -1.0 no call), 8 tasks x 8 episodes a
step, one optimizer step of 64 episodes, beta 0, temperature 1, grad clip 1.0, constant learning rates, one torch
thread, and the trainable parameters `agentrl grpo --config chat` trains: LoRA r16 on every linear layer plus the
norm gains (peft modules_to_save), Adam (eps 1e-5) at 5e-4, the gains at 1e-2 (the same optimizer groups on both
sides; TRL gets them through its `optimizers=` argument). With LoRA alone the held-out sampled accuracy of this
model does not move in 40 steps (measured: 0.35 throughout; docs/sampled-accuracy.md explains why).
- agentrl: GRPOTrainer.train(CalculatorToolEnv, tasks) (`agentrl grpo --config chat`'s trainer and environment);
- TRL 1.16: GRPOTrainer(tools=[calculator], reward_funcs=<the same rewards from the returned messages>).
Each side saves its LoRA adapter every --eval-every steps (the clock stops while it saves); afterwards every
adapter is scored by the same evaluator (agentrl's rollout, sampled at T=1, --eval-tasks held-out tasks, fixed
seed). Reports s/step and the training wall-clock time to the first checkpoint at or above --target.

TRL needs one thing a user must add for this model: a response template on the tokenizer, so that TRL can parse
the `<tool_call>` JSON (TRL ships templates only for the chat templates of known model families; our template is
not one of them and TRL raises "Unrecognized chat template, failed to add response schema"). The one set here
says what the chat template says: tool calls between <tool_call> and </tool_call>, the turn ends at <|im_end|>.
The multi-step ReAct calculator (`--config grpo`) cannot run on TRL at all: see README and `--react-probe`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import common  # noqa: E402

SETTINGS = {"tasks_per_step": 8, "num_generations": 8, "learning_rate": 5e-4, "norm_learning_rate": 1e-2,
            "adam_eps": 1e-5, "max_grad_norm": 1.0, "lora_r": 16, "lora_alpha": 32,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "beta": 0.0, "temperature": 1.0, "max_new_tokens_per_turn": 48, "max_turns": 3, "train_tasks": 4000}
# The Hermes call format inside ChatML, as transformers' response templates describe a turn (the fields of the
# assistant message and what opens and closes each); our chat template renders exactly this.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def tool_rewards(messages: list[dict], task: dict) -> float:
    """agentrl's ToolEnv rewards, read from the messages TRL returns (assistant turns, tool results)."""
    from agentrl.envs.calculator import numeric_match

    ok = sum(m["role"] == "tool" and not str(m["content"]).startswith("{'error'") for m in messages)
    failed = sum(m["role"] == "tool" for m in messages) - ok
    malformed = any(m["role"] == "assistant" and "<tool_call>" in str(m.get("content") or "") for m in messages)
    last = messages[-1] if messages else {}
    answer = last.get("content") if last.get("role") == "assistant" and not last.get("tool_calls") else None
    correct = bool(answer) and numeric_match(task, answer)
    if ok:
        return 1.0 if correct else 0.2
    return -0.5 if failed or malformed else -1.0


def lora(model):
    """LoRA on every linear layer and trainable norm gains, as agentrl's jobs make it (jobs/common.add_lora)."""
    from peft import LoraConfig, get_peft_model

    norms = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if name and "norm" in type(module).__name__.lower()})
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=SETTINGS["lora_r"], lora_alpha=SETTINGS["lora_alpha"],
                                            lora_dropout=0.0, target_modules=SETTINGS["target_modules"],
                                            modules_to_save=norms))


def optimizer(model):
    """Adam with the norm gains at their own rate: the groups agentrl's GRPOConfig(norm_learning_rate=...) makes."""
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    norms = [p for n, p in params if "norm" in n]
    rest = [p for n, p in params if "norm" not in n]
    return torch.optim.Adam([{"params": rest, "lr": SETTINGS["learning_rate"]},
                             {"params": norms, "lr": SETTINGS["norm_learning_rate"]}], eps=SETTINGS["adam_eps"])


class Checkpoints:
    """Saves the adapter every `every` steps; the training clock excludes the saving."""

    def __init__(self, out: Path, every: int):
        self.out, self.every, self.clock, self.paused, self.rows = out, every, common.StepClock(), 0.0, []
        self.start = None

    def begin(self):
        self.start = time.perf_counter()
        self.clock.tick()

    def after_step(self, step: int, model) -> None:
        self.clock.tick()
        if step % self.every == 0:
            t = time.perf_counter()
            model.save_pretrained(self.out / f"step-{step}")
            self.rows.append({"step": step, "train_s": t - self.start - self.paused,
                              "train_cpu_s": sum(self.clock.cpu_steps)})
            self.paused += time.perf_counter() - t
            self.clock.last, self.clock.last_cpu = time.perf_counter(), time.process_time()


def train_agentrl(args, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl import GRPOConfig, GRPOTrainer
    from agentrl.envs import CalculatorToolEnv, calculator_tasks
    from agentrl.rollout import SamplingParams

    s = SETTINGS
    tok = AutoTokenizer.from_pretrained(args.model)
    model = lora(AutoModelForCausalLM.from_pretrained(args.model, dtype="float32"))
    config = GRPOConfig(tasks_per_step=s["tasks_per_step"], num_generations=s["num_generations"],
                        mini_batch_size=s["tasks_per_step"] * s["num_generations"], learning_rate=s["learning_rate"],
                        adam_eps=s["adam_eps"], norm_learning_rate=s["norm_learning_rate"],
                        max_grad_norm=s["max_grad_norm"], beta=s["beta"], temperature=s["temperature"], seed=0)
    trainer = GRPOTrainer(config, model, tok)
    ckpt = Checkpoints(out, args.eval_every)
    ckpt.begin()
    trainer.train(lambda: CalculatorToolEnv(format="chat", max_turns=s["max_turns"]),
                  calculator_tasks(s["train_tasks"], seed=0), steps=args.steps,
                  sampling=SamplingParams(max_new_tokens=s["max_new_tokens_per_turn"]), progress=False,
                  callback=lambda step, stats: ckpt.after_step(step, trainer.policy))
    return {"steps": ckpt.clock.steps, "cpu_steps": ckpt.clock.cpu_steps, "checkpoints": ckpt.rows}


def train_trl(args, out: Path) -> dict:
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.envs.calculator import calculator, calculator_tasks

    s = SETTINGS
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.response_template = RESPONSE_TEMPLATE
    tasks = calculator_tasks(s["train_tasks"], seed=0)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"]}
                              for t in tasks])

    def reward(completions, answer, **kwargs):
        return [tool_rewards(c, {"answer": a}) for c, a in zip(completions, answer)]

    ckpt = Checkpoints(out, args.eval_every)

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            ckpt.begin()

        def on_step_end(self, a, state, control, model=None, **kw):
            ckpt.after_step(state.global_step, model)

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", bf16=False,
            gradient_checkpointing=False, seed=0, per_device_train_batch_size=s["tasks_per_step"] * s["num_generations"],
            num_generations=s["num_generations"], learning_rate=s["learning_rate"], adam_epsilon=s["adam_eps"],
            max_grad_norm=s["max_grad_norm"], beta=s["beta"], temperature=s["temperature"], top_k=0, top_p=1.0,
            lr_scheduler_type="constant", max_completion_length=s["max_new_tokens_per_turn"] * s["max_turns"],
            max_tool_calling_iterations=s["max_turns"] - 1)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
        # A chat turn ends at <|im_end|>: TRL stops generating at the model's generation_config EOS ids (chat models
        # ship theirs with the turn-end token, as Qwen's do); ours lists only <|eos|>.
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
        model = lora(model)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                              tools=[calculator], callbacks=[Clock()], optimizers=(optimizer(model), None))
        trainer.train()
    return {"steps": ckpt.clock.steps, "cpu_steps": ckpt.clock.cpu_steps, "checkpoints": ckpt.rows}


def evaluate(model_dir: str, adapter: str | None, n: int, seed: int = 0) -> float:
    """Held-out sampled (T=1) accuracy through agentrl's rollout, the same for every adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs import CalculatorToolEnv, calculator_tasks
    from agentrl.rollout import SamplingParams, rollout

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    if adapter:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    torch.manual_seed(seed)
    episodes = rollout(model.eval(), tok, lambda: CalculatorToolEnv(format="chat", max_turns=SETTINGS["max_turns"]),
                       calculator_tasks(n, seed=0, split="eval"),
                       SamplingParams(max_new_tokens=SETTINGS["max_new_tokens_per_turn"]))
    return sum(bool(ep.info.get("correct")) for ep in episodes) / len(episodes)


def side_main(args) -> None:
    common.one_thread()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model_name:  # the real model's sides
        import agent_real

        args.config = agent_real.REAL_MODELS[args.model_name]
        result = (agent_real.train_trl if args.side == "trl" else agent_real.train_agentrl)(args, out)
    else:
        result = (train_agentrl if args.side == "agentrl" else train_trl)(args, out)
    if args.side == "trl":
        import trl
        result["library"] = f"TRL {trl.__version__}"
    else:
        import agentrl
        result["library"] = f"agentrl {agentrl.__version__}"
    common.emit(result)


def run_side(side: str, cmd: list[str], env: dict) -> dict:
    """One side's worker process: its PEER-RESULT with its wall time, or {"error": the last lines it printed}."""
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEER-RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"{side} failed (exit {proc.returncode}):\n{tail}", flush=True)
        return {"error": tail}
    return {**json.loads(lines[-1][len("PEER-RESULT "):]), "wall_s": time.time() - started}


def time_to_target(result: dict, target: float) -> None:
    """The training time (wall and CPU) at the first scored checkpoint at or above `target`, or None."""
    hit = [row for row in result["checkpoints"] if row["accuracy"] >= target]
    result["time_to_target_s"] = hit[0]["train_s"] if hit else None
    result["cpu_time_to_target_s"] = hit[0]["train_cpu_s"] if hit else None


def ensure_chat_model(path: Path) -> None:
    if not (path / "config.json").exists():
        from agentrl.jobs.base_model import build_base_model
        from agentrl.models.tiny import BaseModelConfig

        build_base_model(path, BaseModelConfig(corpus="chat", steps=1000), progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["agentrl", "agentrl-ppo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None,
                        help="the chat model (default: MODELS_DIR/chat, built if absent), or smollm2-135m")
    parser.add_argument("--sft-model", default="runs/real-sft/model",
                        help="smollm2-135m only: the SFT model every side starts from (trained if absent)")
    parser.add_argument("--models-dir", default="runs/peers-models")
    parser.add_argument("--peers-dir", default=".venv-peers")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.7, help="held-out sampled accuracy to reach")
    parser.add_argument("--work-dir", default="runs/agent-task")
    parser.add_argument("--sides", default="agentrl,trl",
                        help="which sides to train (comma-separated; smollm2-135m also has agentrl-ppo)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.side:
        return side_main(args)
    import agent_real

    if args.model in agent_real.REAL_MODELS:
        args.model_name = args.model
        return agent_real.main(args)
    model = Path(args.model or Path(args.models_dir) / "chat").resolve()
    ensure_chat_model(model)
    work = Path(args.work_dir).resolve()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))  # both import the same tool function
    print(f"load average before: {os.getloadavg()}", flush=True)
    sides = {}
    pythons = {"agentrl": sys.executable, "trl": str(Path(args.peers_dir).resolve() / "trl116/bin/python")}
    for side in args.sides.split(","):
        python = pythons[side]
        cmd = [python, str(Path(__file__).resolve()), "--side", side, "--out", str(work / side), "--model", str(model),
               "--steps", str(args.steps), "--eval-every", str(args.eval_every)]
        sides[side] = run_side(side, cmd, env)
        if "error" in sides[side]:
            continue
        print(f"{side}: {len(sides[side]['steps'])} steps, median {statistics.median(sides[side]['steps']):.2f} s/step, "
              f"peak RSS {sides[side]['peak_rss_mb']:.0f} MB", flush=True)
    common.one_thread()
    base = evaluate(str(model), None, args.eval_tasks)
    print(f"base model: held-out sampled accuracy {base:.3f}", flush=True)
    for side, r in sides.items():
        if "error" in r:
            continue
        for row in r["checkpoints"]:
            row["accuracy"] = evaluate(str(model), str(work / side / f"step-{row['step']}"), args.eval_tasks)
            print(f"  {side} step {row['step']:3d}: {row['train_s']:7.1f} s ({row['train_cpu_s']:7.1f} CPU s) of training, "
                  f"held-out sampled accuracy "
                  f"{row['accuracy']:.3f}", flush=True)
        time_to_target(r, args.target)
        r["s_per_step"] = statistics.median(r["steps"])
        r["cpu_s_per_step"] = statistics.median(r["cpu_steps"])
        print(f"{side}: time to {args.target}: {r['time_to_target_s']} s of training; median {r['s_per_step']:.2f} s/step, "
              f"{r['cpu_s_per_step']:.2f} CPU s/step", flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": SETTINGS, "target": args.target, "base_accuracy": base,
                                               "sides": sides, "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
