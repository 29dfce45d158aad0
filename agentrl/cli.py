"""`agentrl` command line: argparse only; each command runs one job of agentrl/jobs/."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path


def _cmd_base_model(args) -> int:
    from agentrl.config import apply_overrides, from_dict
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    config = from_dict(BaseModelConfig, apply_overrides({}, args.overrides))
    out = build_base_model(args.out, config)
    print(open(out / "agentrl_base.json").read())
    return 0


def _training_job(args, algo: str):
    """The job config of `agentrl ppo` / `agentrl grpo`: an `algo` in the file or the overrides that names the
    other algorithm is an error (it used to win silently over the command, or lose to it)."""
    from agentrl.jobs.ppo import load_job

    return load_job(args.config, args.overrides, command={"algo": algo})


def _cmd_ppo(args) -> int:
    from agentrl.jobs.ppo import run_job

    _print_summary(run_job(_training_job(args, "ppo")))
    return 0


def _cmd_grpo(args) -> int:
    from agentrl.jobs.ppo import run_job

    _print_summary(run_job(_training_job(args, "grpo")))
    return 0


def _cmd_sft(args) -> int:
    from agentrl.jobs.sft import load_sft_job, run_sft_job

    summary = run_sft_job(load_sft_job(args.config, args.overrides))
    g, s = summary["after"], summary["after_sampled"]
    print(f"\nSFT: {summary['demonstrations']} demonstrations ({summary['skipped_rows']} bad rows skipped), "
          f"{summary['steps']} steps, final loss {summary['final_loss']:.3f}, {summary['train_seconds']} s")
    print(f"held-out tasks: {summary['eval_tasks']}  accuracy {g['accuracy']:.3f} (sampled T=1: {s['accuracy']:.3f})  "
          f"tool_call_rate {g['tool_call_rate']:.3f}  format_error_rate {g['format_error_rate']:.3f}")
    print(f"model: {summary['model_dir']}  (train it: agentrl ppo --config ... model.base={summary['model_dir']})")
    return 0


def _cmd_dpo(args) -> int:
    from agentrl.jobs.dpo import load_dpo_job, run_dpo_job

    summary = run_dpo_job(load_dpo_job(args.config, args.overrides))
    _print_summary(summary, summary and f"pairs: {summary['pairs']} (ties skipped: {summary['ties_skipped']})")
    return 0


def _cmd_preferences(args) -> int:
    from agentrl.jobs.preferences import run_preferences

    print(json.dumps(run_preferences(args.model, args.adapter, args.env, args.env_kwargs, args.task_source, args.tasks,
                                     args.seed, args.split, args.samples, args.temperature, args.max_new_tokens,
                                     args.out, tasks_kwargs=args.tasks_kwargs, judge=args.judge)))
    return 0


def _cmd_reward_model(args) -> int:
    from agentrl.jobs.reward_model import load_reward_config, run_reward_model_job

    meta = run_reward_model_job(load_reward_config(args.config, args.overrides))
    print(json.dumps(meta, indent=2))
    return 0


def _cmd_compare(args) -> int:
    from agentrl.jobs.compare import run_compare

    samples_path = args.samples_out or (str(Path(args.out).with_name("samples.jsonl")) if args.out else None)
    result = run_compare(args.a, args.b, args.env, args.env_kwargs, args.task_source, args.tasks, args.seed, args.judge,
                         args.sample, args.max_new_tokens, args.out, samples_path, tasks_kwargs=args.tasks_kwargs)
    low, high = result["ci95"]
    print(f"A: {args.a}\nB: {args.b}\njudge: {args.judge}, {result['n']} tasks")
    print(f"A wins {result['wins']}, ties {result['ties']}, losses {result['losses']}; "
          f"win-rate of A {result['win_rate']:.3f} (95% CI {low:.3f}-{high:.3f})")
    for s in result["samples"]:
        print(f"\n{s['task']}\n  A ({s['score_a']:+.2f}): {s['a']!r}\n  B ({s['score_b']:+.2f}): {s['b']!r}")
    if samples_path:
        print(f"A/B episodes: {samples_path} (agentrl report {Path(samples_path).parent})")
    return 0


def _cmd_quickstart(args) -> int:
    from agentrl.jobs.ppo import load_job, run_job

    overrides = [f"out_dir={args.out}"] + args.overrides
    _print_summary(run_job(load_job("quickstart", overrides)), f"summary written to {args.out}/summary.json")
    return 0


def _cmd_eval(args) -> int:
    from agentrl.jobs.evaluate import run_eval

    metrics = run_eval(args.model, args.adapter, args.env, args.env_kwargs, args.task_source, args.tasks, args.seed,
                       args.sample, args.temperature, args.max_new_tokens, args.out, tasks_kwargs=args.tasks_kwargs)
    print(json.dumps(metrics, indent=2))
    return 0


def _cmd_report(args) -> int:
    from agentrl.errors import UserError
    from agentrl.jobs.report import run_report

    if bool(args.run) == bool(args.compare):
        raise UserError("agentrl report: give RUN_DIR or --compare RUN_A RUN_B (one of them)")
    path = run_report(args.run, args.compare, args.out, args.screenshot)
    print(f"report: {Path(path).resolve()}")
    if args.screenshot:
        print(f"screenshot: {args.screenshot}")
    return 0


def _print_summary(summary: dict | None, footer: str | None = None) -> None:
    """Held-out metrics, sampled at the training temperature first (what RL optimises), greedy beside it; then
    `footer`. None (another process of several: the main one reports): nothing."""
    if summary is None:
        return
    print(f"\nheld-out tasks: {summary['eval_tasks']:<8}{'sampled (T=1)':>20}{'greedy':>18}")
    print(f"  {'':<22}{'before':>10}{'after':>10}{'before':>10}{'after':>10}")
    for key in ("accuracy", "tool_call_rate", "mean_score", "format_error_rate", "mean_turns"):
        cells = [summary[part][key] for part in ("before_sampled", "after_sampled", "before", "after")]
        print(f"  {key:<22}" + "".join(f"{c:>10.3f}" for c in cells))
    print(f"{summary['algo'].upper()} steps: {summary['steps']}  training time: {summary['train_seconds']} s  "
          f"total: {summary['wall_seconds']} s")
    print(f"adapter: {summary['adapter_dir']}")
    if footer:
        print(footer)


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _positive_finite(text: str) -> float:
    """argparse type: a finite number > 0 (temperatures)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _json_object(text: str) -> str:
    """argparse type: a JSON object (kept as its text; the job parses it)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"not a JSON object ({getattr(e, 'msg', e)}): {text[:80]}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {type(value).__name__}: {text[:80]}")
    return text


def _output_file(text: str) -> str:
    """argparse type: a file path to write; a directory there is refused before the work, not after it."""
    if not text or Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text or repr(text)} is a directory; give a file path")
    return text


def _env_arguments(p: argparse.ArgumentParser, tasks: int) -> None:
    """The options every command that runs an environment shares."""
    p.add_argument("--env", default="agentrl.envs:CalculatorEnv", help="module:Class of the environment")
    p.add_argument("--env-kwargs", type=_json_object, default=None, help="JSON object passed to the environment")
    p.add_argument("--task-source", default="agentrl.envs:calculator_tasks", help="module:function or .jsonl")
    p.add_argument("--tasks-kwargs", type=_json_object, default=None,
                   help="JSON object of more keyword arguments of the task function")
    p.add_argument("--tasks", type=_at_least_one, default=tasks)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=_at_least_one, default=48)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl", description="RL for tool-using LLM agents")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    # --debug after the command too (`agentrl ppo --debug ...`); SUPPRESS keeps the top-level value otherwise
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("base-model", help="build (or reuse) the embedded tiny base model",
                       parents=[debug])
    p.add_argument("--out", default="runs/base-model")
    p.add_argument("overrides", nargs="*", help="BaseModelConfig fields as key=value")
    p.set_defaults(func=_cmd_base_model)

    for name, help_text, example, func in (
            ("ppo", "run a PPO job from a YAML config", "quickstart", _cmd_ppo),
            ("grpo", "run a GRPO / Dr. GRPO / RLOO job from a YAML config", "grpo", _cmd_grpo),
            ("sft", "SFT on demonstrations (sft.data=... or env.demonstrations=...) -> out_dir/model", "quickstart",
             _cmd_sft),
            ("dpo", "DPO: offline on a pairs file (data=...) or iterative from an environment", "dpo", _cmd_dpo)):
        p = sub.add_parser(name, help=help_text, parents=[debug])
        p.add_argument("--config", required=True, help=f"a YAML file, or a shipped config name ({example})")
        p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        p.set_defaults(func=func)

    p = sub.add_parser("preferences", help="sample K trajectories per task and write best/worst pairs", parents=[debug])
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", default=None)
    _env_arguments(p, tasks=256)
    p.add_argument("--split", default="train", choices=["train", "eval"])
    p.add_argument("--samples", type=_at_least_one, default=4, help="trajectories per task (K)")
    p.add_argument("--temperature", type=_positive_finite, default=1.0)
    p.add_argument("--out", type=_output_file, required=True, help="pairs JSONL to write")
    p.add_argument("--judge", default=None, help="an LLM judge's choice instead of the environment's score: JSON of "
                   "reward.judge keys, e.g. '{\"mode\": \"ranking\", \"model\": \"smollm2-135m\"}' (docs/judge.md)")
    p.set_defaults(func=_cmd_preferences)

    p = sub.add_parser("reward-model", help="train a Bradley-Terry reward model from preference pairs", parents=[debug])
    p.add_argument("--config", default=None, help="a YAML file of RewardModelConfig fields")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=_cmd_reward_model)

    p = sub.add_parser("compare", help="win-rate of model A against model B on the same tasks and seeds",
                       parents=[debug])
    p.add_argument("--a", required=True, help="MODEL_DIR or MODEL_DIR:ADAPTER_DIR")
    p.add_argument("--b", required=True, help="MODEL_DIR or MODEL_DIR:ADAPTER_DIR")
    _env_arguments(p, tasks=200)
    p.add_argument("--judge", default="env", help="env, or reward-model:PATH")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--out", type=_output_file, default=None, help="also write the result to this JSON file")
    p.add_argument("--samples-out", type=_output_file, default=None,
                   help="A/B episodes for `agentrl report` (default: samples.jsonl beside --out)")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("quickstart", help="base model -> eval -> PPO -> eval, on the calculator", parents=[debug])
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the quickstart config")
    p.set_defaults(func=_cmd_quickstart)

    p = sub.add_parser("report", help="write RUN_DIR/report.html: summary, curves and episodes of a run",
                       parents=[debug])
    p.add_argument("run", nargs="?", help="a run directory (out_dir of a ppo/grpo/dpo job)")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="overlay two runs' curves")
    p.add_argument("--out", type=_output_file, default=None,
                   help="HTML file to write (default: in the (first) run directory)")
    p.add_argument("--screenshot", type=_output_file, default=None, help="also save a PNG of the page (needs Chromium)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("eval", help="evaluate a model (and adapter) on held-out tasks", parents=[debug])
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", default=None)
    _env_arguments(p, tasks=200)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=_positive_finite, default=1.0)
    p.add_argument("--out", type=_output_file, default=None, help="also write the metrics to this JSON file")
    p.set_defaults(func=_cmd_eval)
    return parser


@contextlib.contextmanager
def _os_exit_raises():
    """While a job runs, os._exit called in this process raises SystemExit instead of ending it at once.

    User code runs inside the job (a tool on a thread, an environment), and os._exit there would end the run
    with that status, 0 included, past every handler and with nothing written. As SystemExit it becomes a failed
    tool call or a named environment error like sys.exit. Forked children (tool process isolation, the MCP
    server's launcher) still exit: the check is on the process id. A net, not a guarantee (posix._exit, a crash):
    isolation="process" is the tools' guarantee.
    """
    real, pid = os._exit, os.getpid()

    def _exit(status: int) -> None:
        if os.getpid() != pid:
            real(status)
        raise SystemExit(f"os._exit({status!r})")

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _exit_now(status: int) -> None:
    """End the process after a stop signal without waiting for threads still in user code: a tool call that
    hangs inside an environment's step pool would hold the interpreter's exit until its deadline (or forever).
    The atexit handlers still run (trackers, the MCP servers' clean-up); only the joins of running threads are
    skipped."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _term_outside_a_step(signum, frame) -> None:
    from agentrl.errors import SignalExit

    os.write(2, b"agentrl: SIGTERM outside a training step: exiting (what finished is saved); status 143\n")
    raise SignalExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from agentrl.errors import SignalExit, UserError

    args = build_parser().parse_args(argv)
    if argv is None:  # the command line: a SIGTERM where no job's handler is set says so (as Ctrl-C does)
        signal.signal(signal.SIGTERM, _term_outside_a_step)
    try:
        with _os_exit_raises():
            return args.func(args)
    except SignalExit as e:  # SIGTERM/SIGINT: its message is already out, its status is 128 + the signal
        if argv is not None:  # called from Python: the caller decides
            raise
        _exit_now(e.code)
    except KeyboardInterrupt:  # Ctrl-C before the job set its handlers (while torch and the model load)
        if args.debug:
            raise
        print("agentrl: SIGINT before the job started: exiting; status 130", file=sys.stderr)
        return 130
    except SystemExit as e:
        # Only user code (an environment, a tool, a tasks function) calls sys.exit inside a job; the places that
        # call it are wrapped and name themselves, and this is the net for any other: never an exit 0 with no result.
        if args.debug:
            raise
        print(f"agentrl: error: sys.exit({e.code!r}) was called inside the job (by user code: an environment, "
              f"a tool or a tasks function); the job did not finish", file=sys.stderr)
        return 2
    except UserError as e:  # a mistake in the config, the data or a path: one line, not a traceback
        if args.debug:
            raise
        print(f"agentrl: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:
        # A checkpoint that cannot be resumed, or a run stopped by non-finite losses: one line, no traceback.
        # (Looked up, not imported: agentrl.checkpoint pulls in torch, and raised these only if it is loaded.)
        checkpoint = sys.modules.get("agentrl.checkpoint")
        if checkpoint is not None and isinstance(e, (checkpoint.CheckpointError, checkpoint.NonFiniteError)):
            print(f"agentrl: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
