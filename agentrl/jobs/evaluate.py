"""The job behind `agentrl eval`: run a policy on held-out tasks and report the environment metrics.

Every other job evaluates through `evaluate` too, before and after training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from agentrl.errors import UserError
from agentrl.rollout.engine import episode_metrics, rollout
from agentrl.rollout.sampling import SamplingParams

SUMMARY_KEYS = ("accuracy", "tool_call_rate", "mean_score", "format_error_rate", "mean_turns", "truncation_rate")


@torch.no_grad()
def evaluate(model, tokenizer, env_factory: Callable, tasks: list[dict], greedy: bool = True,
             temperature: float = 1.0, max_new_tokens: int = 48, seed: int = 0,
             mixed_precision: str = "no", max_context: int | None = None,
             max_observation_tokens: int | None = None, share_prefix: bool = False,
             compact: bool = False) -> dict[str, float]:
    """Metrics of one episode per task: greedy decoding by default, else sampling at `temperature`.

    Several processes: each rolls out its contiguous share of the tasks (sampling with seed `seed + rank`), and
    the metrics are computed over every process's episodes, in task order, on every process. Every process
    must call it (under FSDP / ZeRO-3 inside gathered_for_generation). One process: all tasks, seed `seed`.
    """
    from agentrl.distributed import gather_in_order, partial_state
    from agentrl.precision import resolve_mixed_precision

    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=not greedy,
                            max_context=max_context, max_observation_tokens=max_observation_tokens,
                            share_prefix=share_prefix, compact=compact)
    state = partial_state()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + state.process_index)
    device_type = next(model.parameters()).device.type
    bf16 = resolve_mixed_precision(mixed_precision, device_type) == "bf16"
    with state.split_between_processes(tasks) as mine, torch.autocast(device_type, dtype=torch.bfloat16,
                                                                      enabled=bf16):
        episodes = gather_in_order(rollout(model, tokenizer, env_factory, mine, params, generator=generator))
    metrics = {k.removeprefix("env/"): v for k, v in episode_metrics(episodes).items()}
    metrics = {k: round(metrics[k], 4) for k in SUMMARY_KEYS}
    metrics["decoding"] = "greedy" if greedy else f"sampled(T={temperature})"
    metrics["tasks"] = len(tasks)
    return metrics


def load_policy(model_dir: str, adapter_dir: str | None = None, **load_kwargs):
    """(model, tokenizer) from a saved base model and, optionally, a PEFT adapter on top of it.
    load_kwargs go to from_pretrained (dtype, device_map, attn_implementation, quantization_config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors import SafetensorError

    from agentrl.models.pretrained import resolve_model_dir
    from agentrl.trainers.common import default_pad_token

    if adapter_dir and Path(adapter_dir).exists() and not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise UserError(f"{adapter_dir}: not a PEFT adapter directory (no adapter_config.json in it)")
    model_dir = resolve_model_dir(model_dir)  # a preset name or a GGUF file: its converted directory

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs)
    except (OSError, ValueError, ImportError, SafetensorError) as e:  # no such directory, no or truncated files
        raise UserError(f"{model_dir}: cannot load a model and its tokenizer ({str(e).splitlines()[0]})") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"{model_dir}: its tokenizer has no EOS token, so no episode could end; set eos_token in "
                        f"its tokenizer_config.json")
    default_pad_token(tokenizer)
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < len(tokenizer):
        raise UserError(f"{model_dir}: the model's vocabulary ({vocab} embeddings) is smaller than its tokenizer's "
                        f"({len(tokenizer)} tokens); ids past {vocab - 1} would fail (resize_token_embeddings)")
    if adapter_dir:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter_dir)
        except (OSError, ValueError) as e:
            raise UserError(f"{adapter_dir}: cannot load a PEFT adapter ({str(e).splitlines()[0]})") from None
    return model.eval(), tokenizer


def run_eval(model: str, adapter: str | None, env: str, env_kwargs: str | None, task_source: str, tasks: int,
             seed: int, sample: bool, temperature: float, max_new_tokens: int, out: str | None,
             tasks_kwargs: str | None = None) -> dict:
    """`agentrl eval`: metrics of a saved model (and adapter) on `tasks` held-out tasks, written to `out` if set."""
    from agentrl.checkpoint import write_json
    from agentrl.distributed import is_main_process
    from agentrl.envs.base import load_tasks, make_env

    policy, tokenizer = load_policy(model, adapter)
    kwargs = json.loads(env_kwargs) if env_kwargs else {}
    task_list = load_tasks(task_source, tasks, seed, "eval", json.loads(tasks_kwargs) if tasks_kwargs else None)
    metrics = evaluate(policy, tokenizer, lambda: make_env(env, kwargs), task_list, greedy=not sample,
                       temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    if out and is_main_process():
        write_json(out, metrics)
    return metrics
