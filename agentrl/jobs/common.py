"""What every job shares: the model, environment and rollout sections of its config, the held-out split,
and the `Run` a job starts from (base model, tokenizer, environment factory, held-out tasks)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import to_dict
from agentrl.envs.base import load_tasks, make_env
from agentrl.models.tiny import BaseModelConfig

CONFIG_DIR = Path(__file__).parent.parent / "configs"


@dataclass
class ModelSection:
    base: str = "embedded"  # a local model directory, or "embedded" to build/reuse the tiny default
    base_dir: str = "runs/base-model"  # where the embedded model is built and cached
    builder: BaseModelConfig = field(default_factory=BaseModelConfig)  # how the embedded model is built
    lora: bool = True  # train a LoRA adapter (reference = adapter disabled); False: full fine-tuning
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout (the trainer runs in eval mode, so it is off either way)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    train_norms: bool = True  # with LoRA, also train the normalisation gains (peft modules_to_save; see add_lora)


@dataclass
class EnvSection:
    name: str = "agentrl.envs:CalculatorEnv"  # "module:Class" of the environment
    kwargs: dict = field(default_factory=dict)  # passed to the environment's constructor
    tasks: str = "agentrl.envs:calculator_tasks"  # "module:function(n, seed, split)" or a .jsonl file
    train_tasks: int = 4000  # training tasks drawn (split "train")
    eval_tasks: int = 200  # held-out tasks (split "eval"), never seen in SFT or PPO


@dataclass
class RolloutSection:
    max_new_tokens: int = 48  # per model turn
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off


def resolve_config_path(name: str) -> Path:
    """A path, or the name of a config shipped with agentrl (`quickstart` -> agentrl/configs/quickstart.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    shipped = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    return shipped if shipped.exists() else path


@dataclass
class Run:
    """What every job starts from: the base model, its tokenizer, the environment and the held-out tasks."""

    base_dir: str
    model: object
    tokenizer: object
    env_factory: object
    eval_tasks: list[dict]
    max_new_tokens: int
    eval_seed: int

    def evaluate_both(self, model, temperature: float) -> dict:
        """Greedy and sampled metrics on the same held-out tasks and seed."""
        from agentrl.jobs.evaluate import evaluate

        kw = {"max_new_tokens": self.max_new_tokens, "seed": self.eval_seed}
        return {"greedy": evaluate(model, self.tokenizer, self.env_factory, self.eval_tasks, True, **kw),
                "sampled": evaluate(model, self.tokenizer, self.env_factory, self.eval_tasks, False, temperature, **kw)}

    def train_tasks(self, spec: str, n: int, seed: int) -> list[dict]:
        """Training tasks with every held-out task removed; an error if none remain."""
        held_out = {t.get("question", str(t)) for t in self.eval_tasks}
        tasks = [t for t in load_tasks(spec, n, seed, "train") if t.get("question", str(t)) not in held_out]
        if not tasks or not self.eval_tasks:
            raise ValueError(f"{spec}: {len(tasks)} training tasks remain after removing the "
                             f"{len(self.eval_tasks)} held-out ones; both must be non-empty")
        return tasks


def prepare_run(model_cfg: ModelSection, env_cfg: EnvSection, rollout_cfg: RolloutSection, eval_seed: int,
                progress: bool) -> Run:
    from agentrl.jobs.base_model import build_base_model
    from agentrl.jobs.evaluate import load_policy

    base_dir = model_cfg.base
    if base_dir == "embedded":
        base_dir = str(build_base_model(model_cfg.base_dir, model_cfg.builder, progress=progress))
    model, tokenizer = load_policy(base_dir)
    env_factory = lambda: make_env(env_cfg.name, env_cfg.kwargs)  # noqa: E731
    env_factory()  # fail early on a bad environment spec
    eval_tasks = load_tasks(env_cfg.tasks, env_cfg.eval_tasks, eval_seed, "eval")
    return Run(base_dir, model, tokenizer, env_factory, eval_tasks, rollout_cfg.max_new_tokens, eval_seed)


def norm_module_names(model) -> list[str]:
    """Names (last component) of the model's normalisation layers: RMSNorm / LayerNorm modules."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and "norm" in type(module).__name__.lower()})


def add_lora(model, model_cfg: ModelSection):
    """A LoRA adapter on `target_modules`; with `train_norms`, the norm gains train too (a few K parameters).

    Why the norms: the final RMSNorm fixes the norm of the hidden state that meets the (tied) LM head, so
    LoRA on the linear layers cannot scale the logits; it can only turn the hidden state. Sharpening a
    copy from p=0.9 to p=0.99 at temperature 1 needs exactly that scale (docs/sampled-accuracy.md: with
    LoRA alone, held-out sampled accuracy stalls near 0.5 while greedy is 0.98). LongLoRA (Chen et al.
    2023, arXiv:2309.12307, sec. 3.3) likewise found trainable normalisation layers necessary for LoRA.
    """
    from peft import LoraConfig, get_peft_model

    if not model_cfg.lora:
        return model
    extra = norm_module_names(model) if model_cfg.train_norms else None
    model = get_peft_model(model, LoraConfig(r=model_cfg.lora_r, lora_alpha=model_cfg.lora_alpha,
                                             lora_dropout=model_cfg.lora_dropout, bias="none",
                                             target_modules=list(model_cfg.target_modules), task_type="CAUSAL_LM",
                                             modules_to_save=extra))
    # peft keeps target_modules as a set and saves it in hash order; sorted, equal runs save equal files.
    model.peft_config["default"].target_modules = sorted(model.peft_config["default"].target_modules)
    return model


def warn_ineffective(config, algo: str) -> None:
    """Settings that cannot take effect in this job: a warning naming the key, once, at start."""
    from agentrl.trainers.grpo import GRPOConfig
    from agentrl.trainers.ppo import PPOConfig

    def warn(key: str, why: str) -> None:
        warnings.warn(f"config {key}: {why}", UserWarning, stacklevel=3)

    if config.model.lora and config.model.lora_dropout > 0:
        warn("model.lora_dropout", "has no effect: the trainers keep the model in eval mode (dropout off)")
    if algo in ("ppo", "grpo"):
        for key, value, off in (("rollout.top_k", config.rollout.top_k, 0), ("rollout.top_p", config.rollout.top_p, 1.0)):
            if value != off:
                warn(key, f"={value} shapes what is sampled, but the {algo.upper()} ratio and KL use logprobs of "
                          "the full tempered distribution, so the update does not correct for it")
    if algo == "ppo":
        ppo, default = config.ppo, PPOConfig()
        for key in ("use_score_scaling", "use_score_norm", "score_clip"):
            if getattr(ppo, key) != getattr(default, key):
                warn(f"ppo.{key}", "only applies to trainer.step(); the agent loop of this job ignores it")
        for key in ("forward_batch_size", "optimize_cuda_cache", "optimize_device_cache", "compare_steps",
                    "push_to_hub_if_best_kwargs"):
            if getattr(ppo, key) != getattr(default, key):
                warn(f"ppo.{key}", "is accepted for TRL 0.11 parity and has no effect")
        if ppo.steps != default.steps:
            warn("ppo.steps", f"is ignored by the job, which runs `steps` ({config.steps})")
    if algo == "grpo":
        grpo = config.grpo
        if grpo.steps != GRPOConfig().steps:
            warn("grpo.steps", f"is ignored by the job, which runs `steps` ({config.steps})")
        if grpo.mini_batch_size > grpo.batch_size:
            warn("grpo.mini_batch_size", f"={grpo.mini_batch_size} is larger than the batch (tasks_per_step * "
                                         f"num_generations = {grpo.batch_size}): one mini-batch of {grpo.batch_size}")
        per_step = -(-grpo.batch_size // grpo.mini_batch_size) * grpo.num_iterations
        if per_step % grpo.gradient_accumulation_steps:
            warn("grpo.gradient_accumulation_steps", f"={grpo.gradient_accumulation_steps} does not divide the "
                 f"{per_step} mini-batches of a step: an optimizer step mixes gradients of two batches")
    if hasattr(config, "reward") and not config.reward.models and config.reward.weight != type(config.reward)().weight:
        warn("reward.weight", "has no effect without reward.models")


def summary_config(config) -> dict:
    """The config recorded in summary.json: everything but `resume`, so a resumed run's summary equals the
    uninterrupted run's."""
    return {k: v for k, v in to_dict(config).items() if k != "resume"}
