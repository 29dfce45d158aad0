"""agentrl against its peers, side by side in one run: PPO vs TRL 0.11.4, GRPO and DPO vs TRL 1.16.0.

    bash benchmarks/peers/setup.sh                       # once: the peers' venvs in .venv-peers/
    python benchmarks/peers/run.py --json runs/peers.json [--quick] [--models embedded,26m] [--tasks ppo,grpo,dpo]
    python benchmarks/peers/run.py --models 26m-v151936 --tasks dpo   # the 26 M body with Qwen's vocabulary
    python benchmarks/peers/run.py --models smollm2-135m --repeats 1 [--precision bf16]   # the real model

Each (task, model) runs agentrl and the peer interleaved (`--repeats` pairs of processes, A first in one pair,
B in the next), every run in its own process with one torch thread. By default the two processes of a pair run
at once and take turns step by step (lockstep: A's step, B's step, A's, ...; never both at the same time), so
each step of one library is timed next to a step of the other; `--no-lockstep` runs one process after the
other. Both sides run on the same weights, tokenizer, LoRA, batch and lengths (common.py). The models
(the embedded 150 K model and a seeded random Llama of 26 M parameters; `26m-vN`: the same body with a
vocabulary of N, of which the workload uses the tokenizer's first 322 ids) and the workload are made once under
--models-dir and loaded by both sides. Prints each task's settings side by side, then the table: median seconds
per step over the timed steps of all repeats (the first --warmup steps of each process are not timed), peak RSS
(the largest of the repeats), the ratio peer / agentrl (> 1: agentrl is faster; "paired": the median over
each timed step against the other side's step of the same index) and whether both sides'
trainable parameters moved. The load average is printed before and after: this machine is shared.
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
sys.path.insert(0, str(HERE))
import common  # noqa: E402

MODELS = {"embedded": "embedded 150 K", "26m": "Llama 26 M", "smollm2-135m": "SmolLM2-135M-Instruct"}
REAL_MODELS = {"smollm2-135m"}  # agentrl's presets: the weights of a pretrained model, its tokenizer and template


def base_model(model: str) -> str:
    """The body a model name stands for ("26m-v151936" -> "26m"): its STEPS."""
    return model.split("-v")[0]


def model_label(model: str) -> str:
    """"26m-v151936" -> "Llama 26 M body, vocabulary 151,936"."""
    return MODELS.get(model) or f"{MODELS['26m']} body, vocabulary {int(model.split('-v')[1]):,}"


# (untimed warm-up steps, timed steps) per process. A 26 M step's time moves by 10-30% from one step to the next on
# this shared 2-core machine (one GRPO process measured 5.6-6.2 s, the next 7.0-8.1 s on the same work), so the
# 26 M rows time 2-5 steps a process after one warm-up; a 26 M PPO step is ~25 CPU seconds.
STEPS = {("ppo", "embedded"): (1, 2), ("grpo", "embedded"): (1, 3), ("dpo", "embedded"): (1, 5),
         ("ppo", "26m"): (1, 2), ("grpo", "26m"): (1, 3), ("dpo", "26m"): (1, 5),
         ("ppo", "smollm2-135m"): (1, 1), ("grpo", "smollm2-135m"): (1, 1), ("dpo", "smollm2-135m"): (1, 2)}
LLAMA_26M = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
             "intermediate_size": 1408, "max_position_embeddings": 256}


# --- models and workload (made once, read by both sides) ------------------------------------------------

def prepare(models_dir: Path, models: list[str] = ("26m",)) -> None:
    """The embedded model (agentrl's own builder), a seeded random 26 M Llama with its tokenizer (and each
    `26m-vN` of `models`: the same body with a vocabulary of N), the workload."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agentrl.jobs.base_model import build_base_model

    embedded = models_dir / "embedded"
    if not (embedded / "config.json").exists():
        build_base_model(embedded, progress=False)
    tok = AutoTokenizer.from_pretrained(embedded)
    for name in {"26m", *(m for m in models if m.startswith("26m-v"))}:
        big = models_dir / name
        if not (big / "config.json").exists():
            torch.manual_seed(0)
            vocab = int(name.split("-v")[1]) if "-v" in name else len(tok)
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=vocab, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, attention_dropout=0.0, **LLAMA_26M))
            model.save_pretrained(big)
            tok.save_pretrained(big)
    workload = models_dir / "workload.json"
    if not workload.exists():
        workload.write_text(json.dumps(make_workload(tok)))
    for name in REAL_MODELS.intersection(models):
        prepare_real(models_dir, name)


def workload_path(models_dir: Path, model: str) -> Path:
    """The 26 M models share the embedded tokenizer's workload; a real model has its own (its ids, its template)."""
    return models_dir / (f"workload-{model}.json" if model in REAL_MODELS else "workload.json")


def prepare_real(models_dir: Path, name: str) -> None:
    """A pretrained preset, as agentrl converts it (a plain model directory), linked under models_dir where both
    sides load it, and its workload: the word-problem task's prompts as the chat rollout renders them (SmolLM2's
    template drops tools, so agentrl writes the calculator's schema into the system message), their token ids,
    and DPO pairs of whole conversations (the tool call, its result and the answer; against a wrong guess)."""
    import random

    from transformers import AutoTokenizer

    from agentrl.envs import WordProblemEnv, word_problem_tasks
    from agentrl.envs.chat import conversation_segments
    from agentrl.envs.word_problems import word_problem_messages
    from agentrl.models.pretrained import resolve_model_dir

    link = models_dir / name
    if not link.exists():
        link.symlink_to(resolve_model_dir(name), target_is_directory=True)
    workload = workload_path(models_dir, name)
    if workload.exists():
        return
    tok = AutoTokenizer.from_pretrained(link)
    env = WordProblemEnv()
    env.bind_tokenizer(tok)
    tasks = word_problem_tasks(256, seed=0)
    prompts = [env.reset(t) for t in tasks]
    rng, pairs, lengths = random.Random(0), [], []
    for task, prompt in zip(tasks, prompts):
        row = {"prompt": prompt}
        for key, use_tool in (("chosen", True), ("rejected", False)):
            demo = word_problem_messages(task, use_tool, rng)
            segments = conversation_segments(tok, demo["messages"][:1], demo["messages"][1:], demo["tools"])
            row[key] = "".join(text for text, _ in segments)
        pairs.append(row)
        lengths.append(sum(len(tok(row[k], add_special_tokens=False)["input_ids"]) for k in row))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    workload.write_text(json.dumps({"ppo_query_ids": ids, "prompts": prompts, "pairs": pairs,
                                    "pair_tokens_mean": round(sum(lengths) / len(lengths), 1),
                                    "settings": common.REAL_MODEL_TASKS}))


def make_workload(tok) -> dict:
    """PPO queries of exactly 14 token ids, GRPO prompt texts, DPO pairs (prompt; chosen: the tool call, its
    observation and the answer; rejected: a guess), about 60 tokens a pair."""
    import random

    from agentrl.envs import calculator_demonstration, calculator_tasks

    tasks = calculator_tasks(2000, seed=0)
    n = common.TASKS["ppo"]["query_tokens"]
    queries = [ids for ids in (tok(f"Question: {t['question']}\n")["input_ids"] for t in tasks) if len(ids) == n]
    rng, pairs, lengths = random.Random(0), [], []
    for t in tasks[:256]:
        chosen = calculator_demonstration(t, True, rng)
        rejected = calculator_demonstration(t, False, rng)
        action = chosen[1][0][chosen[1][0].index("Action:"):]  # the Thought line left out: shorter pairs
        row = {"prompt": chosen[0][0], "chosen": action + "".join(s for s, _ in chosen[2:]),
               "rejected": "".join(s for s, _ in rejected[1:])}
        pairs.append(row)
        lengths.append(sum(len(tok(row[k], add_special_tokens=k == "prompt")["input_ids"]) for k in row))
    return {"ppo_query_ids": queries[:256], "prompts": [f"Question: {t['question']}\n" for t in tasks[:256]],
            "pairs": pairs, "pair_tokens_mean": round(sum(lengths) / len(lengths), 1)}


# --- running the two sides --------------------------------------------------------------------------------

def _command(side: str, task: str, model_dir: Path, workload: Path, steps: int, warmup: int, python: str,
             extra: list[str] = ()) -> tuple[list[str], dict]:
    script = HERE / ("agentrl_side.py" if side == "agentrl" else "trl_side.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", WANDB_DISABLED="true")
    env.pop(common.LOCKSTEP_ENV, None)
    if side != "agentrl":
        env.pop("PYTHONPATH", None)  # the peer's venv must not see agentrl's checkout
    return [python, str(script), "--task", task, "--model", str(model_dir), "--workload", str(workload),
            "--warmup", str(warmup), "--steps", str(steps), *extra], env


def _result(side: str, task: str, model_dir: Path, returncode: int, stdout: str, stderr: str, started: float) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("PEER-RESULT ")]
    if returncode or not lines:
        tail = "\n".join((stdout + stderr).splitlines()[-25:])
        raise RuntimeError(f"{side} {task} on {model_dir.name} failed (exit {returncode}):\n{tail}")
    result = json.loads(lines[-1][len("PEER-RESULT "):])
    result["wall_s"] = round(time.time() - started, 1)
    return result


def worker(side: str, task: str, model_dir: Path, workload: Path, steps: int, warmup: int, python: str,
           extra: list[str] = ()) -> dict:
    """One side's process on its own (--no-lockstep)."""
    cmd, env = _command(side, task, model_dir, workload, steps, warmup, python, extra)
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return _result(side, task, model_dir, proc.returncode, proc.stdout, proc.stderr, started)


def lockstep(commands: list[tuple[list[str], dict]]) -> list[tuple[int, str, str]]:
    """Two processes at once, taking turns between their StepClock ticks (common.Baton over a socket pair): the
    first command's process runs a step while the other waits, then the other, and so on; when one exits, the
    other goes on alone. commands: two (argv, env). -> (returncode, stdout, stderr) of each."""
    import socket
    import threading

    ends = socket.socketpair()
    procs = []
    try:
        for (cmd, env), end, first in zip(commands, ends, ("1", "0")):
            env = dict(env, **{common.LOCKSTEP_ENV: f"{end.fileno()},{first}"})
            procs.append(subprocess.Popen(cmd, env=env, pass_fds=[end.fileno()], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    except BaseException:  # the second could not start (a missing venv): do not leave the first running alone
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise
    finally:
        for end in ends:  # each child holds its own end: a child that exits closes its end for the other
            end.close()
    outputs = [None] * len(procs)
    # A reader thread per process, so that neither blocks on a full pipe while the other waits for its turn.
    threads = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, procs[i].communicate()))
               for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [(proc.returncode, *out) for proc, out in zip(procs, outputs)]


def lockstep_pair(sides: list[tuple[str, str]], task: str, model_dir: Path, workload: Path, steps: int, warmup: int,
                  extra: list[str] = ()) -> dict:
    """Both sides' processes at once, in turns (`lockstep`), the first of `sides` ((side, python) pairs) first:
    each step of one library is timed right next to a step of the other, so a change in the machine's speed
    during the run (this VM's steps drift by 10-30% over minutes) reaches both sides alike. Both load their
    models at the same time; the turns start with the first side's warm-up step. -> {side: result}"""
    started = time.time()
    done = lockstep([_command(side, task, model_dir, workload, steps, warmup, python, extra) for side, python in sides])
    return {side: _result(side, task, model_dir, *out, started) for (side, _), out in zip(sides, done)}


def summarise(runs: list[dict]) -> dict:
    """Several processes of one side -> median s/step over their timed steps, the largest peak RSS, moved."""
    timed = [s for r in runs for s in r["steps"][r["warmup"]:]]
    cpu = [s for r in runs for s in r["cpu_steps"][r["warmup"]:]]
    return {"s_per_step": statistics.median(timed), "cpu_s_per_step": statistics.median(cpu), "steps_timed": len(timed),
            "s_per_step_all": [round(s, 4) for s in timed], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "moved": all(r["moved"]["changed"] > 0 and r["moved"]["compared"] == r["moved"]["tensors"] for r in runs),
            "max_abs_change": min(r["moved"]["max_abs_change"] for r in runs)}


def ratio(agentrl: dict, peer: dict, key: str = "s_per_step") -> float:
    """peer s/step over agentrl s/step: above 1, agentrl is faster."""
    return peer[key] / agentrl[key]


def paired_ratios(agentrl_runs: list[dict], peer_runs: list[dict], key: str = "cpu_steps") -> list[float]:
    """peer / agentrl for each timed step against the other side's step of the same index in the same pair of
    processes (in lockstep: the steps that ran back to back), over all pairs."""
    out = []
    for a, p in zip(agentrl_runs, peer_runs):
        out += [ps / as_ for as_, ps in zip(a[key][a["warmup"]:], p[key][p["warmup"]:]) if as_ > 0]
    return out


def paired(ratios: list[float] | None) -> str:
    """"x1.31 (1.22-1.40)": the median of the paired ratios and their range."""
    if not ratios:
        return "-"
    return f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def table(rows: list[dict]) -> str:
    """The side-by-side markdown table (what the README shows)."""
    def moved(row):
        return ("yes / yes" if row["agentrl"]["moved"] and row["peer"]["moved"] else
                f"{'yes' if row['agentrl']['moved'] else 'NO'} / {'yes' if row['peer']['moved'] else 'NO'}")

    lines = ["| step | model | agentrl s/step | peer | peer s/step | peer / agentrl | CPU s/step agentrl / peer "
             "| CPU peer / agentrl | paired CPU peer / agentrl | peak RSS agentrl / peer | params moved agentrl / peer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        a, p = row["agentrl"], row["peer"]
        lines.append(f"| {row['label']} | {row['model']} | {a['s_per_step']:.3f} | {row['peer_name']} | "
                     f"{p['s_per_step']:.3f} | x{ratio(a, p):.2f} | {a['cpu_s_per_step']:.3f} / {p['cpu_s_per_step']:.3f} "
                     f"| x{ratio(a, p, 'cpu_s_per_step'):.2f} | {paired(row.get('paired_cpu_ratios'))} "
                     f"| {a['peak_rss_mb']:.0f} / {p['peak_rss_mb']:.0f} MB "
                     f"| {moved(row)} |")
    return "\n".join(lines)


def side_by_side(task: str, model: str, a: dict, p: dict) -> str:
    """Both sides' effective settings, one key a line, so a difference shows."""
    out = [f"  {'setting':34s} {'agentrl':44s} peer"]
    for group in ("model", "settings"):
        for key in sorted(set(a[group]) | set(p[group])):
            out.append(f"  {key:34s} {json.dumps(a[group].get(key, '-')):44s} {json.dumps(p[group].get(key, '-'))}")
    out.append(f"  {'library':34s} {a['library']:44s} {p['library']}")
    out.append(f"  {'versions':34s} {json.dumps(a['versions']):44s} {json.dumps(p['versions'])}")
    out.append(f"  {'torch threads':34s} {a['threads']!s:44s} {p['threads']}")
    return f"{task} on {model_label(model)}:\n" + "\n".join(out)


def label(task: str, work: dict) -> str:
    """The table's step column, from the settings both sides ran with (common.task_settings)."""
    s = common.task_settings(task, work)
    if task == "ppo":
        lengths = sorted(map(len, work["ppo_query_ids"][:s["batch_size"]]))
        query = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
        return (f"PPO ({s['batch_size']} x {query}+<={s['response_tokens']} tokens, mini-batch {s['mini_batch_size']}, "
                f"{s['ppo_epochs']} epochs)")
    if task == "grpo":
        return f"GRPO ({s['prompts']} prompts x {s['num_generations']}, <= {s['completion_tokens']} new tokens, beta 0)"
    return f"DPO (batch {s['batch_size']}, ~{round(work['pair_tokens_mean'])} tokens a pair)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded,26m")
    parser.add_argument("--tasks", default="ppo,grpo,dpo")
    parser.add_argument("--repeats", type=int, default=2, help="A B pairs per (task, model)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps at the start of each process "
                        "(default: per task and model, see STEPS)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default: per task and model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: embedded model, 1 pair, 1 timed step")
    parser.add_argument("--models-dir", default="runs/peers-models")
    parser.add_argument("--peers-dir", default=".venv-peers", help="where setup.sh made trl011/ and trl116/")
    parser.add_argument("--json", default=None, help="write every run's results and the table here")
    parser.add_argument("--no-lockstep", dest="lockstep", action="store_false",
                        help="run each process alone, one after the other (default: the two sides' processes of "
                        "a pair run at once and take turns step by step)")
    parser.add_argument("--precision", choices=("no", "bf16"), default="no",
                        help="both sides: fp32 (no), or bf16 autocast (PPO: accelerate's mixed precision on both)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.repeats, args.steps = ("embedded" if args.models == "embedded,26m" else args.models), 1, 1
        args.warmup = 1 if args.warmup is None else args.warmup
    models_dir = Path(args.models_dir).resolve()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS and not (m.startswith("26m-v") and m[5:].isdigit())]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {sorted(MODELS)} or 26m-vN (N: a vocabulary size)")
    prepare(models_dir, models)
    peers = Path(args.peers_dir).resolve()
    load_before = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
    rows, started = [], time.time()
    for model in models:
        work = json.loads(workload_path(models_dir, model).read_text())
        for task in args.tasks.split(","):
            warmup, steps = STEPS[(task, base_model(model))]
            warmup = warmup if args.warmup is None else args.warmup
            steps = steps if args.steps is None else args.steps
            peer_python = str(peers / common.PEER_VENV[task] / "bin" / "python")
            runs = {"agentrl": [], "peer": []}
            for repeat in range(args.repeats):  # pairs of processes: agentrl starts the even ones, the peer the odd ones
                sides = [("agentrl", sys.executable), ("peer", peer_python)][:: 1 if repeat % 2 == 0 else -1]
                work_args = (task, models_dir / model, workload_path(models_dir, model), steps, warmup)
                if args.lockstep:
                    results = lockstep_pair(sides, *work_args, ["--precision", args.precision])
                else:
                    results = {side: worker(side, *work_args, python, ["--precision", args.precision])
                               for side, python in sides}
                for side, _ in sides:
                    r = results[side]
                    runs[side].append(r)
                    print(f"  {task} {model} {side}: {[round(s, 3) for s in r['steps']]} s/step, "
                          f"CPU {[round(s, 3) for s in r['cpu_steps']]}, {r['peak_rss_mb']:.0f} MB, "
                          f"moved {r['moved']['max_abs_change']:.2e} ({r['wall_s']} s)", flush=True)
            print(side_by_side(task, model, runs["agentrl"][0], runs["peer"][0]), flush=True)
            rows.append({"task": task, "model": model_label(model), "label": label(task, work)
                         + (", bf16 autocast both" if args.precision == "bf16" else ""),
                         "peer_name": common.PEER[task], "agentrl": summarise(runs["agentrl"]),
                         "peer": summarise(runs["peer"]), "runs": runs, "lockstep": args.lockstep,
                         "paired_cpu_ratios": [round(x, 4) for x in paired_ratios(runs["agentrl"], runs["peer"])]})
            save(args.json, rows, load_before)  # after every row, so a long run's finished rows are kept
    text = save(args.json, rows, load_before)
    print(f"\n{text}\n\nload average before {' '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.time() - started:.0f} s; {os.cpu_count()} CPUs")


def save(path: str | None, rows: list[dict], load_before) -> str:
    text = table(rows)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"rows": rows, "table": text, "load_before": load_before,
                                          "load_after": os.getloadavg(), "argv": sys.argv}, indent=1))
    return text


if __name__ == "__main__":
    main()
