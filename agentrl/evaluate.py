"""Evaluation: run a policy on held-out tasks and report the environment metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from agentrl.rollout.engine import episode_metrics, rollout
from agentrl.rollout.sampling import SamplingParams

SUMMARY_KEYS = ("accuracy", "tool_call_rate", "mean_score", "format_error_rate", "mean_turns", "truncation_rate")


@torch.no_grad()
def evaluate(model, tokenizer, env_factory: Callable, tasks: list[dict], greedy: bool = True,
             temperature: float = 1.0, max_new_tokens: int = 48, seed: int = 0) -> dict[str, float]:
    """Metrics of one episode per task: greedy decoding by default, else sampling at `temperature`."""
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=not greedy)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    episodes = rollout(model, tokenizer, env_factory, tasks, params, generator=generator)
    metrics = {k.removeprefix("env/"): v for k, v in episode_metrics(episodes).items()}
    metrics = {k: round(metrics[k], 4) for k in SUMMARY_KEYS}
    metrics["decoding"] = "greedy" if greedy else f"sampled(T={temperature})"
    metrics["tasks"] = len(tasks)
    return metrics


def load_policy(model_dir: str, adapter_dir: str | None = None):
    """(model, tokenizer) from a saved base model and, optionally, a PEFT adapter on top of it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval(), tokenizer


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
