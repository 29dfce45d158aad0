"""The agent task on a real pretrained model: `agent_task.py --model smollm2-135m` (see agent_task.py for the
embedded-model comparison this extends).

SmolLM2-135M-Instruct, after the same SFT (`agentrl sft --config real`: the shipped recipe, whose demonstrations
call the calculator on half the word problems and guess on the other half), learns to call the calculator on
arithmetic word problems. The sides, each from that SFT model with the shipped real-model config's settings:
- agentrl GRPO: `agentrl grpo --config real`'s trainer, environment (WordProblemEnv) and tasks;
- agentrl PPO (side `agentrl-ppo`): `agentrl ppo --config real`'s;
- TRL 1.16 GRPO with `tools=[calculator]`: the same LoRA (r 16 on q/k/v/o, norms frozen), learning rate, Adam
  epsilon, 4 tasks x 4 generations per rollout, 2 passes of 2 mini-batches of 8, beta 0.04 (k3 to the adapter
  switched off), grad clip 1.0, temperature 1, bf16 autocast where agentrl's `mixed_precision: auto` picks it.

What TRL needs for this model, that a user must add: SmolLM2's chat template renders neither `tools=` nor an
assistant's `tool_calls`, and TRL refuses it ("The provided chat template does not support tool calling").
agentrl handles such templates itself (agentrl.envs.chat: the schemas in the system message, calls as Hermes
text). TRL gets the same prompts (the system message agentrl writes, checked token for token against the
rollout's) and a template that is SmolLM2's plus the calls as `<tool_call>` text, the form agentrl writes;
`RESPONSE_TEMPLATE` parses them back. One rollout's token budget: agentrl 48 new tokens a turn, 3 turns; TRL
144 completion tokens in all (tool results included), its own way of bounding multi-turn completions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

REAL_MODELS = {"smollm2-135m": "real"}  # preset -> the shipped config its SFT and RL settings come from
# SmolLM2's own template, with an assistant's tool calls rendered as the Hermes text agentrl writes
# (agentrl.envs.chat.tool_call_text: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, one per call).
TOOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% if message['content'] %}{{ '\n' }}"
    "{% endif %}{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '\n</tool_call>' }}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def real_job(config_name: str, sft_model: str, algo: str, eval_tasks: int):
    """The shipped real-model job config for `algo`, from the SFT model (what `agentrl grpo|ppo --config real
    model.base=<sft>` runs)."""
    from agentrl.jobs.ppo import load_job

    return load_job(config_name, [f"model.base={sft_model}", f"env.eval_tasks={eval_tasks}", "progress=false"],
                    command={"algo": algo})


def train_agentrl(args, out: Path) -> dict:
    """agentrl's GRPO or PPO trainer as its job builds it (jobs/ppo.run_job without the evaluations)."""
    import torch

    from agentrl.jobs.common import add_lora, prepare_run, rollout_sampling
    from agentrl.jobs.ppo import make_trainer

    from agent_task import Checkpoints

    algo = "ppo" if args.side == "agentrl-ppo" else "grpo"
    config = real_job(args.config, args.model, algo, args.eval_tasks)
    algo_config = config.ppo if algo == "ppo" else config.grpo
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, False, config.sft)
    train_tasks = run.train_tasks(config.env, config.env.train_tasks, algo_config.seed)
    torch.manual_seed(algo_config.seed)
    model = add_lora(run.model, config.model)
    trainer = make_trainer(config, model, run.tokenizer, len(train_tasks), run.eval_tasks)
    ckpt = Checkpoints(out, args.eval_every)
    ckpt.begin()
    trainer.train(run.env_factory, train_tasks, steps=args.steps,
                  sampling=rollout_sampling(config.rollout, algo_config.temperature), progress=False,
                  callback=lambda step, stats: ckpt.after_step(step, trainer.policy))
    return {"steps": ckpt.clock.steps, "cpu_steps": ckpt.clock.cpu_steps, "checkpoints": ckpt.rows,
            "settings": {"algo": algo, "mixed_precision": algo_config.mixed_precision,
                         "episodes_per_step": algo_config.batch_size}}


def trl_data(args, work: Path) -> Path:
    """The TRL side's data, written by the agentrl side's Python: the training tasks of the agentrl job (held-out
    ones removed), each as the chat messages agentrl renders (the tool block in the system message), and the
    settings of the job's grpo section. The rendered prompt is checked against the rollout's, token for token."""
    from transformers import AutoTokenizer

    from agentrl.envs.calculator import calculator
    from agentrl.envs.chat import tools_system_text
    from agentrl.envs.tools import tool_schema
    from agentrl.jobs.common import environment_factory, tasks_of, training_tasks

    config = real_job(args.config, args.model, "grpo", args.eval_tasks)
    eval_tasks = tasks_of(config.env, config.env.eval_tasks, config.eval_seed, "eval")
    tasks = training_tasks(config.env, config.grpo.seed, eval_tasks)
    system = tools_system_text([tool_schema(calculator)])
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": t["question"]}],
             "answer": t["answer"]} for t in tasks]
    tok = AutoTokenizer.from_pretrained(args.model)
    env = environment_factory(config.env)()
    env.bind_tokenizer(tok)
    for row, task in list(zip(rows, tasks))[:20]:
        ours = env.reset(task)
        theirs = tok.apply_chat_template(row["prompt"], chat_template=TOOL_TEMPLATE, add_generation_prompt=True,
                                         tokenize=False)
        if ours != theirs:
            raise SystemExit(f"the TRL prompt differs from agentrl's rollout prompt:\n{ours!r}\n{theirs!r}")
    g, m = config.grpo, config.model
    settings = {"learning_rate": g.learning_rate, "tasks_per_step": g.tasks_per_step,
                "num_generations": g.num_generations, "num_iterations": g.num_iterations,
                "mini_batch_size": g.mini_batch_size, "beta": g.beta, "max_grad_norm": g.max_grad_norm,
                "adam_eps": g.adam_eps, "temperature": g.temperature, "bf16": g.mixed_precision == "bf16",
                "lora_r": m.lora_r, "lora_alpha": m.lora_alpha, "lora_dropout": m.lora_dropout,
                "target_modules": list(m.target_modules), "max_new_tokens_per_turn": config.rollout.max_new_tokens,
                "max_turns": env.max_turns}
    if m.train_norms:
        raise SystemExit("the TRL side trains no norm gains; the config's model.train_norms must be false")
    path = work / "trl-data.json"
    path.write_text(json.dumps({"rows": rows, "settings": settings}))
    return path


def train_trl(args, out: Path) -> dict:
    """TRL 1.16's GRPOTrainer with tools=[calculator] on the same prompts, LoRA and settings."""
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.envs.calculator import calculator
    from agent_task import RESPONSE_TEMPLATE, Checkpoints, tool_rewards

    data = json.loads(Path(args.data).read_text())
    s = data["settings"]
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.chat_template = TOOL_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    dataset = Dataset.from_list(data["rows"])

    def reward(completions, answer, **kwargs):
        return [tool_rewards(c, {"answer": a}) for c, a in zip(completions, answer)]

    batch = s["tasks_per_step"] * s["num_generations"]
    # TRL counts optimizer steps; agentrl's step is one rollout and its num_iterations x (batch / mini-batch)
    # optimizer steps. Checkpoints are taken at the same rollout counts on both sides.
    updates = s["num_iterations"] * batch // s["mini_batch_size"]
    ckpt = Checkpoints(out, args.eval_every)

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            ckpt.begin()

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % updates == 0:
                ckpt.after_step(state.global_step // updates, model)

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=args.steps * updates, logging_steps=1, report_to="none", save_strategy="no",
            bf16=s["bf16"], use_cpu=True, gradient_checkpointing=False, seed=0,
            per_device_train_batch_size=s["mini_batch_size"], generation_batch_size=batch,
            num_generations=s["num_generations"], num_iterations=s["num_iterations"],
            learning_rate=s["learning_rate"], adam_epsilon=s["adam_eps"], weight_decay=0.0,
            max_grad_norm=s["max_grad_norm"], beta=s["beta"], temperature=s["temperature"], top_k=0, top_p=1.0,
            lr_scheduler_type="constant", loss_type="dapo", scale_rewards="group",
            max_completion_length=s["max_new_tokens_per_turn"] * s["max_turns"],
            max_tool_calling_iterations=s["max_turns"] - 1)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>")]
        lora = LoraConfig(task_type="CAUSAL_LM", r=s["lora_r"], lora_alpha=s["lora_alpha"],
                          lora_dropout=s["lora_dropout"], target_modules=s["target_modules"])
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tok, tools=[calculator], callbacks=[Clock()], peft_config=lora)
        trainer.train()
        logs = [row for row in trainer.state.log_history if "reward" in row]
    return {"steps": ckpt.clock.steps, "cpu_steps": ckpt.clock.cpu_steps, "checkpoints": ckpt.rows,
            "settings": {**s, "optimizer_steps_per_rollout": updates},
            "train_reward": [round(r["reward"], 3) for r in logs],
            "tool_call_frequency": [round(r.get("tools/call_frequency", 0.0), 3) for r in logs]}


class Evaluator:
    """Held-out sampled (T=1) metrics of the SFT model with an adapter, through the real job's own evaluator. The
    job (its tasks, environments and the SFT model itself) is built once; each adapter is loaded on a fresh copy of
    the SFT model, since PEFT wraps the model it is given in place."""

    def __init__(self, args):
        from agentrl.jobs.common import prepare_run

        self.args, self.config = args, real_job(args.config, args.model, "grpo", args.eval_tasks)
        c = self.config
        self.run = prepare_run(c.model, c.env, c.rollout, c.eval_seed, False, c.sft)

    def __call__(self, adapter: str | None) -> dict:
        from agentrl.jobs.evaluate import evaluate, load_policy

        c, run = self.config, self.run
        model, tok = load_policy(self.args.model, adapter) if adapter else (run.model, run.tokenizer)
        return evaluate(model.eval(), tok, run.env_factory, run.eval_tasks, False, 1.0,
                        max_new_tokens=c.rollout.max_new_tokens, seed=c.eval_seed,
                        mixed_precision=c.grpo.mixed_precision, share_prefix=c.rollout.share_prefix)


def ensure_sft_model(args) -> None:
    """The shared starting point: `agentrl sft --config real` (skipped when --model already holds one)."""
    if (Path(args.model) / "config.json").exists():
        return
    out = Path(args.model).parent
    print(f"training the SFT model: agentrl sft --config {args.config} out_dir={out}", flush=True)
    subprocess.run([sys.executable, "-m", "agentrl.cli", "sft", "--config", args.config, f"out_dir={out}",
                    "progress=false"], check=True)


def main(args) -> None:
    """Train every side (one at a time, one thread each), then score every checkpoint the same way."""
    import statistics

    from agent_task import run_side, time_to_target

    args.config = REAL_MODELS[args.model_name]
    args.model = str(Path(args.sft_model).resolve())
    ensure_sft_model(args)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = trl_data(args, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    pythons = {"agentrl": sys.executable, "agentrl-ppo": sys.executable,
               "trl": str(Path(args.peers_dir).resolve() / "trl116/bin/python")}
    print(f"load average before: {os.getloadavg()}", flush=True)
    sides = {}
    for side in args.sides.split(","):
        cmd = [pythons[side], str(HERE / "agent_task.py"), "--side", side, "--out", str(work / side),
               "--model", args.model, "--model-name", args.model_name, "--steps", str(args.steps),
               "--eval-every", str(args.eval_every), "--eval-tasks", str(args.eval_tasks), "--data", str(data)]
        sides[side] = run_side(side, cmd, env)
        if "error" in sides[side]:
            continue
        print(f"{side}: {len(sides[side]['steps'])} steps (each a rollout and its optimizer steps), "
              f"{sides[side]['wall_s']:.0f} s, peak RSS {sides[side]['peak_rss_mb']:.0f} MB", flush=True)
    print(f"load average after training: {os.getloadavg()}", flush=True)
    evaluate = Evaluator(args)
    base = evaluate(None)
    print(f"SFT model: held-out sampled accuracy {base['accuracy']:.3f}, tool-call rate {base['tool_call_rate']:.3f}",
          flush=True)
    for side, r in sides.items():
        if "error" in r:
            continue
        for row in r["checkpoints"]:
            m = evaluate(str(work / side / f"step-{row['step']}"))
            row.update(accuracy=m["accuracy"], tool_call_rate=m["tool_call_rate"])
            print(f"  {side} step {row['step']:3d}: {row['train_s']:7.1f} s ({row['train_cpu_s']:7.1f} CPU s) of "
                  f"training, held-out sampled accuracy {row['accuracy']:.3f}, tool-call rate "
                  f"{row['tool_call_rate']:.3f}", flush=True)
        time_to_target(r, args.target)
        r["s_per_step"] = r["checkpoints"][-1]["train_s"] / r["checkpoints"][-1]["step"] if r["checkpoints"] else None
        print(f"{side}: time to {args.target}: {r['time_to_target_s']} s of training "
              f"({statistics.median(r['steps']):.1f} s per step, median)", flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model_name, "sft_model": args.model,
                                               "target": args.target, "sft": base, "sides": sides,
                                               "argv": sys.argv}, indent=1))
