"""What every job shares: the model, environment and rollout sections of its config, the held-out split,
and the `Run` a job starts from (base model, tokenizer, environment factory, held-out tasks)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from agentrl.config import ConfigError, to_dict
from agentrl.envs.base import env_option, load_object, load_tasks, make_env
from agentrl.errors import UserError
from agentrl.models.tiny import BaseModelConfig

CONFIG_DIR = Path(__file__).parent.parent / "configs"


@dataclass
class ModelSection:
    base: str = "embedded"  # a local model directory, a GGUF file, a preset ("smollm2-135m", agentrl.models.pretrained),
    # or "embedded": the tiny model of env.demonstrations (if set), else of the built-in corpus model.builder.corpus
    base_dir: str = "runs/base-model"  # where the embedded model is built and cached (a model of env.demonstrations
    # goes to a sibling directory named by their hash, so no environment ever gets another's model)
    builder: BaseModelConfig = field(default_factory=BaseModelConfig)  # how the embedded model is built
    lora: bool = True  # train a LoRA adapter (reference = adapter disabled); False: full fine-tuning
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout (the trainer runs in eval mode, so it is off either way)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    train_norms: bool | Literal["final"] = True  # with LoRA, also train the normalisation gains (peft
    # modules_to_save; see add_lora); "final": only the last norm before the LM head (a pretrained model's layer
    # gains can be ~1e-3, which Adam at any useful rate rewrites in a step; the final one scales the logits)
    # --- how a model directory is loaded (model_loading_kwargs); mixed precision is ppo/grpo.mixed_precision ---
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the weights' dtype (bfloat16 halves memory)
    device_map: str | None = None  # from_pretrained's device_map ("auto", "cpu", "cuda:0"); None: accelerate places it
    attn_implementation: str | None = None  # "eager", "sdpa", "flash_attention_2", ...; None: transformers' choice
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, more compute
    load_in_4bit: bool = False  # QLoRA: NF4 base weights through bitsandbytes; needs a CUDA GPU, model.lora and
    # `pip install agentrl[quantization]`


@dataclass
class EnvSection:
    name: str = "agentrl.envs:CalculatorEnv"  # "module:Class" of the environment
    kwargs: dict = field(default_factory=dict)  # passed to the environment's constructor
    tasks: str = "agentrl.envs:calculator_tasks"  # "module:function(n, seed, split)" or a .jsonl file
    tasks_kwargs: dict = field(default_factory=dict)  # more keyword arguments of that function (a dataset's name)
    demonstrations: str | None = None  # "module:function(task, rng)" returning one demonstration row
    # (trainers/sft.py), drawn over the training tasks: `agentrl sft`'s data, and the embedded model's
    train_tasks: int = 4000  # training tasks drawn (split "train")
    eval_tasks: int = 200  # held-out tasks (split "eval"), never seen in SFT or PPO
    step_timeout: float | None = None  # seconds env.reset / env.step may run before the episode ends as an
    # infrastructure failure (left out of the loss, counted as env/timeout_rate); None: the environment's own
    # `step_timeout` attribute, else 300 (envs/base.STEP_TIMEOUT); 0: no deadline


@dataclass
class RolloutSection:
    max_new_tokens: int = 48  # per model turn
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    backend: Literal["hf", "vllm"] = "hf"  # who samples the training rollouts: agentrl's sampler over transformers,
    # or a vLLM engine in this process that gets the policy's merged weights after each update (rollout/vllm.py;
    # `pip install agentrl[vllm]`). Evaluation always samples with hf.
    vllm_gpu_memory_utilization: float = 0.3  # vllm: share of GPU memory for vLLM (weights + KV cache); the
    # rest stays with training
    vllm_max_model_len: int | None = None  # vllm: longest prompt + episode in tokens (None: the model's maximum)
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # vllm: its weights' dtype (auto:
    # model.dtype, so its logprobs match the trainer's as closely as the kernels allow)
    vllm_enforce_eager: bool = False  # vllm: no torch.compile / CUDA graphs (starts much faster, samples slower)
    max_context: int | None = None  # tokens an episode may hold, prompt included; a turn or observation that
    # would run past it ends the episode, marked truncated (None: the model's max_position_embeddings)
    max_observation_tokens: int | None = None  # tokens one observation may add; a longer one ends the episode
    # the same way (None: what the context has left)
    share_prefix: bool = False  # prefill the tokens every prompt begins with (system message, tool schemas) once
    # and copy their KV cache to each episode, in training rollouts and evaluation (rollout/sampling.py); the
    # same numbers up to float rounding, so seeded runs sample differently with it on
    compact: bool = False  # rows whose turn has ended leave the decoding batch instead of waiting on padding for
    # the longest (rollout/sampling.py), in training rollouts and evaluation; the same draws, but seeded runs sample
    # differently with it on (the smaller batch's products round differently)


def resolve_config_path(name: str) -> Path:
    """A path, or the name of a config shipped with agentrl (`quickstart` -> agentrl/configs/quickstart.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    shipped = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    return shipped if shipped.exists() else path


def environment_factory(env_cfg: EnvSection):
    """A factory of fresh environments (one per episode), checked once; a bad spec is an error naming the key."""
    try:
        cls = load_object(env_cfg.name)
    except ValueError as e:
        raise ConfigError(f"env.name: {e}") from None

    def factory():
        env = make_env(cls, env_cfg.kwargs)
        if env_cfg.step_timeout is not None:
            env.step_timeout = env_cfg.step_timeout
        return env

    try:
        factory()
    except TypeError as e:  # the protocol's attributes are missing, or the kwargs do not fit the constructor
        raise ConfigError(f"env.name={env_cfg.name}, env.kwargs={env_cfg.kwargs}: {e}") from None
    return factory


def tasks_of(env_cfg: EnvSection, n: int, seed: int, split: str) -> list[dict]:
    try:
        return load_tasks(env_cfg.tasks, n, seed, split, env_cfg.tasks_kwargs)
    except UserError:
        raise
    except ValueError as e:  # the spec does not load
        raise ConfigError(f"env.tasks: {e}") from None


def training_tasks(env_cfg: EnvSection, seed: int, eval_tasks: list[dict]) -> list[dict]:
    """Training tasks with every held-out task removed; an error if none remain."""
    held_out = {t.get("question", str(t)) for t in eval_tasks}
    tasks = [t for t in tasks_of(env_cfg, env_cfg.train_tasks, seed, "train") if t.get("question", str(t)) not in held_out]
    if not tasks or not eval_tasks:
        raise ConfigError(f"env.tasks: {len(tasks)} training tasks remain after removing the "
                          f"{len(eval_tasks)} held-out ones; both must be non-empty")
    return tasks


def renders_chat(env) -> bool:
    """The environment renders conversations with the tokenizer's chat template (ToolEnv in chat format)."""
    return getattr(env, "format", None) == "chat" or bool(env_option(env, "keep_special_tokens"))


def env_demonstrations(env_cfg: EnvSection, n: int, seed: int, eval_tasks: list[dict]) -> list:
    """`n` rows of env.demonstrations over the training tasks (cycled), never a held-out task."""
    from agentrl.trainers.sft import demonstrations_from_function

    tasks = training_tasks(env_cfg, seed, eval_tasks)
    rows = demonstrations_from_function(env_cfg.demonstrations, tasks, n, seed)
    check_demonstrations(make_env(load_object(env_cfg.name), env_cfg.kwargs), tasks, rows)
    return rows


def check_demonstrations(env, tasks: list[dict], rows: list, k: int = 20) -> None:
    """Warn when the first `k` segment rows do not split as this environment's rollouts do: a prompt other than
    reset(task), or a trainable turn that runs past a stop pattern (a rollout would end the turn there)."""
    import re
    import warnings

    if renders_chat(env):
        return
    stops = [re.compile(pattern) for pattern in env.stop_patterns]
    for task, row in zip(tasks, rows[:k]):
        segments = row.get("segments") if isinstance(row, dict) else row
        if not isinstance(segments, (list, tuple)) or not all(isinstance(s, (list, tuple)) and len(s) == 2
                                                                 for s in segments):
            return  # another form; malformed rows are reported by the trainer
        prompt = env.reset(task)
        if segments and segments[0][0] != prompt:
            warnings.warn(f"env.demonstrations: a row's first segment {segments[0][0]!r} is not reset(task) "
                          f"{prompt!r}; the model would learn a prompt it never sees", stacklevel=3)
            return
        for text, trainable in segments[:-1]:
            match = next((m for m in (p.search(text) for p in stops) if m), None) if trainable else None
            if match and match.end() < len(text):
                warnings.warn(f"env.demonstrations: a trainable segment runs past the stop pattern {match.group()!r}"
                              f"; rollouts end the turn there, so split the row at it", stacklevel=3)
                return


def embedded_model(model_cfg: ModelSection, env_cfg: EnvSection, eval_tasks: list[dict], sft=None,
                   chat: bool = False, progress: bool = True) -> str:
    """The embedded model's directory: built from env.demonstrations when set (cached by their hash beside
    model.base_dir), else from the built-in corpus (cached in model.base_dir)."""
    from agentrl.jobs.base_model import build_base_model, build_from_demonstrations, demonstrations_key
    from agentrl.trainers.sft import SFTConfig

    if not env_cfg.demonstrations:
        return str(build_base_model(model_cfg.base_dir, model_cfg.builder, progress=progress))
    sft = sft or SFTConfig()
    rows = env_demonstrations(env_cfg, sft.steps * sft.batch_size, sft.seed, eval_tasks)
    key = demonstrations_key(rows, sft, chat).rpartition(":")[2][:12]
    out = Path(model_cfg.base_dir).with_name(f"{Path(model_cfg.base_dir).name}-{key}")
    return str(build_from_demonstrations(out, rows, model_cfg.builder, sft, chat,
                                         f"env.demonstrations ({env_cfg.demonstrations})", progress))


@dataclass
class Run:
    """What every job starts from: the base model, its tokenizer, the environment and the held-out tasks."""

    base_dir: str
    model: object
    tokenizer: object
    env_factory: object
    eval_tasks: list[dict]
    eval_seed: int
    rollout: RolloutSection = field(default_factory=RolloutSection)  # evaluation's lengths, budgets, sampler

    def eval_kwargs(self) -> dict:
        """evaluate()'s arguments that the rollout section and the evaluation seed decide."""
        r = self.rollout
        return {"max_new_tokens": r.max_new_tokens, "seed": self.eval_seed, "max_context": r.max_context,
                "max_observation_tokens": r.max_observation_tokens, "share_prefix": r.share_prefix,
                "compact": r.compact}

    def evaluate_both(self, model, temperature: float, mixed_precision: str = "no") -> dict:
        """Greedy and sampled metrics on the same held-out tasks and seed (under bf16 autocast with the training's
        mixed_precision "bf16": evaluation samples at the precision the policy trained at)."""
        from agentrl.jobs.evaluate import evaluate

        kw = {**self.eval_kwargs(), "mixed_precision": mixed_precision}
        return {"greedy": evaluate(model, self.tokenizer, self.env_factory, self.eval_tasks, True, **kw),
                "sampled": evaluate(model, self.tokenizer, self.env_factory, self.eval_tasks, False, temperature, **kw)}

    def train_tasks(self, env_cfg: EnvSection, n: int, seed: int) -> list[dict]:
        """`n` training tasks of env_cfg's task source with every held-out task removed (see training_tasks)."""
        return training_tasks(replace(env_cfg, train_tasks=n), seed, self.eval_tasks)


EVAL_FILE = "agentrl_eval.json"  # a model directory's own held-out evaluation, written by the job that made it


def eval_key(env_cfg: EnvSection, eval_seed: int, rollout_cfg: RolloutSection, temperature: float,
             mixed_precision: str = "no") -> dict:
    """What a held-out evaluation depends on besides the weights (the rollout's lengths and budgets included)."""
    env = {k: v for k, v in to_dict(env_cfg).items() if k not in ("demonstrations", "train_tasks", "step_timeout")}
    lengths = {k: getattr(rollout_cfg, k) for k in ("max_new_tokens", "max_context", "max_observation_tokens")}
    for switch in ("share_prefix", "compact"):  # only when on: the keys of evaluations stored without it stay valid
        if getattr(rollout_cfg, switch):
            lengths[switch] = True
    return {"env": env, "eval_seed": eval_seed, **lengths, "temperature": temperature,
            "mixed_precision": mixed_precision}


def stored_eval(model_dir: str, key: dict) -> dict | None:
    """The evaluation saved beside a model (store_eval) when it was made with the same key, else None: the PPO
    job after `agentrl sft` starts from the SFT job's figures instead of evaluating the same model again."""
    import json

    path = Path(model_dir) / EVAL_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = stored.get("key") == json.loads(json.dumps(key)) and stored.get("weights") == _weights_stamp(model_dir)
    return stored.get("result") if same else None


def store_eval(model_dir: str, key: dict, result: dict) -> None:
    from agentrl.checkpoint import write_json

    write_json(Path(model_dir) / EVAL_FILE, {"key": key, "weights": _weights_stamp(model_dir), "result": result})


def _weights_stamp(model_dir: str) -> list:
    """Size and modification time of the directory's weight files: weights changed since, evaluation stale."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in Path(model_dir).glob("*.safetensors"))


def model_loading_kwargs(model_cfg: ModelSection | None) -> dict:
    """from_pretrained keyword arguments of the model.* loading options; an error naming the key for a setting
    this machine cannot honour (4-bit without a CUDA GPU or without bitsandbytes, 4-bit without LoRA)."""
    import os

    import torch

    if model_cfg is None:
        return {}
    kwargs: dict = {"dtype": getattr(torch, model_cfg.dtype)}
    if model_cfg.device_map is not None:
        kwargs["device_map"] = model_cfg.device_map
    if model_cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    if model_cfg.load_in_4bit:
        if not model_cfg.lora:
            raise ConfigError("model.load_in_4bit: 4-bit weights cannot be trained directly; set model.lora=true (QLoRA)")
        if not torch.cuda.is_available():
            raise ConfigError("model.load_in_4bit: needs a CUDA GPU (bitsandbytes' 4-bit kernels) and this machine "
                              "has none; set model.load_in_4bit=false (model.dtype=bfloat16 also halves memory)")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError("model.load_in_4bit: needs bitsandbytes: pip install 'agentrl[quantization]'") from None
        from transformers import BitsAndBytesConfig

        # QLoRA's recipe (Dettmers et al. 2023, arXiv:2305.14314): NF4, double quantization, 16-bit compute.
        compute = torch.bfloat16 if model_cfg.dtype == "float32" else kwargs["dtype"]
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=compute)
        # Quantized weights cannot be moved after loading: place them on this process's GPU now.
        kwargs.setdefault("device_map", {"": int(os.environ.get("LOCAL_RANK", 0))})
    return kwargs


def load_base(base: str, model_cfg: ModelSection | None = None):
    """(model, tokenizer) of model.base, loaded with the model.* loading options; an error naming the key when
    it does not load."""
    from agentrl.jobs.evaluate import load_policy

    kwargs = model_loading_kwargs(model_cfg)
    try:
        return load_policy(base, **kwargs)
    except UserError as e:
        key = "model.attn_implementation" if "attn" in str(e) or "attention" in str(e) else "model.device_map" \
            if "device" in str(e) and "device_map" in kwargs else "model.base"
        raise ConfigError(f"{key}: {e}") from None


def prepare_run(model_cfg: ModelSection, env_cfg: EnvSection, rollout_cfg: RolloutSection, eval_seed: int,
                progress: bool, sft=None) -> Run:
    env_factory = environment_factory(env_cfg)
    eval_tasks = tasks_of(env_cfg, env_cfg.eval_tasks, eval_seed, "eval")
    base_dir = model_cfg.base
    if base_dir == "embedded":
        from agentrl.distributed import is_main_process, wait_for_everyone

        # Several processes: the main one builds (or finds) the cached model, then the others read it.
        if not is_main_process():
            wait_for_everyone()
        base_dir = embedded_model(model_cfg, env_cfg, eval_tasks, sft, renders_chat(env_factory()),
                                  progress and is_main_process())
        if is_main_process():
            wait_for_everyone()
    else:
        from agentrl.models.pretrained import resolve_model_dir

        try:
            base_dir = resolve_model_dir(base_dir)  # a preset or a GGUF: the converted directory (vLLM reads it too)
        except UserError as e:
            raise ConfigError(f"model.base: {e}") from None
    model, tokenizer = load_base(base_dir, model_cfg)
    return Run(base_dir, model, tokenizer, env_factory, eval_tasks, eval_seed, rollout_cfg)


def norm_module_names(model, which: bool | str = True) -> list[str]:
    """Names (last component) of the model's normalisation layers: RMSNorm / LayerNorm modules; which="final":
    the full name of the last one outside the repeated blocks (`model.norm`), the one the LM head reads."""
    norms = [name for name, module in model.named_modules() if name and "norm" in type(module).__name__.lower()]
    if which == "final":
        outside = [name for name in norms if not any(part.isdigit() for part in name.split("."))]
        if not outside:
            raise ConfigError(f"model.train_norms: final: {type(model).__name__} has no normalisation layer outside "
                              f"its blocks (norms: {', '.join(norms[:4]) or 'none'})")
        return [outside[-1]]
    return sorted({name.rsplit(".", 1)[-1] for name in norms})


def add_lora(model, model_cfg: ModelSection):
    """A LoRA adapter on `target_modules`; with `train_norms`, the norm gains train too (a few K parameters).

    First the model.* training options: k-bit preparation (load_in_4bit) and gradient checkpointing.

    Why the norms: the final RMSNorm fixes the norm of the hidden state that meets the (tied) LM head, so
    LoRA on the linear layers cannot scale the logits; it can only turn the hidden state. Sharpening a
    copy from p=0.9 to p=0.99 at temperature 1 needs exactly that scale (docs/sampled-accuracy.md: with
    LoRA alone, held-out sampled accuracy stalls near 0.5 while greedy is 0.98). LongLoRA (Chen et al.
    2023, arXiv:2309.12307, sec. 3.3) likewise found trainable normalisation layers necessary for LoRA.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    if model_cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        # Norms and the LM head to float32, input grads on; checkpointing as configured (non-reentrant, as
        # peft and transformers recommend with adapters).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=model_cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if not model_cfg.lora:
        return model
    extra = norm_module_names(model, model_cfg.train_norms) if model_cfg.train_norms else None
    # peft's own error for a name that matches nothing is a traceback from deep inside it
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"]
    names = sorted({name.rsplit(".", 1)[-1] for name in linear})
    missing = [m for m in model_cfg.target_modules if not any(n == m or n.endswith(f".{m}") for n in linear)]
    if not model_cfg.target_modules or missing:
        raise ConfigError(f"model.target_modules: {missing or '[]'} not among {type(model).__name__}'s linear "
                          f"layers ({', '.join(names)})")
    model = get_peft_model(model, LoraConfig(r=model_cfg.lora_r, lora_alpha=model_cfg.lora_alpha,
                                             lora_dropout=model_cfg.lora_dropout, bias="none",
                                             target_modules=list(model_cfg.target_modules), task_type="CAUSAL_LM",
                                             modules_to_save=extra))
    # peft keeps target_modules as a set and saves it in hash order; sorted, equal runs save equal files.
    model.peft_config["default"].target_modules = sorted(model.peft_config["default"].target_modules)
    return model


def enable_gradient_checkpointing(model) -> None:
    """Activation checkpointing on every decoder layer, non-reentrant (needed with frozen inputs under LoRA;
    transformers then also makes the embeddings' output require grad). The trainers keep checkpointed layers
    in training mode (trainers/common.eval_mode): transformers only checkpoints a layer that is training."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")
    from agentrl.trainers.common import checkpoint_activations

    checkpoint_activations(model)


def warn_ineffective(config, algo: str) -> None:
    """Settings that cannot take effect in this job: a warning naming the key, once, at start."""
    from agentrl.trainers.grpo import GRPOConfig
    from agentrl.trainers.ppo import PPOConfig

    def warn(key: str, why: str) -> None:
        warnings.warn(f"config {key}: {why}", UserWarning, stacklevel=3)

    if algo not in ("ppo", "grpo") and config.rollout.backend != "hf":
        warn("rollout.backend", f"={config.rollout.backend} only applies to PPO and GRPO; {algo} samples with hf")
    if config.model.lora and config.model.lora_dropout > 0:
        warn("model.lora_dropout", "has no effect: the trainers keep the model in eval mode (dropout off)")
    if algo in ("ppo", "grpo"):
        for key, value, off in (("rollout.top_k", config.rollout.top_k, 0), ("rollout.top_p", config.rollout.top_p, 1.0)):
            if value != off:
                warn(key, f"={value} shapes what is sampled, but the {algo.upper()} ratio and KL use logprobs of "
                          "the full tempered distribution, so the update does not correct for it")
    if algo == "ppo":
        ppo, default = config.ppo, PPOConfig()
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


def held_out_summary(before: dict, after: dict) -> dict:
    """A summary's held-out figures: greedy and sampled (Run.evaluate_both), before and after training."""
    return {"before": before["greedy"], "after": after["greedy"],
            "before_sampled": before["sampled"], "after_sampled": after["sampled"]}


def rollout_sampling(rollout_cfg: RolloutSection, temperature: float):
    """The training rollouts' SamplingParams from the rollout section, at the algorithm's temperature."""
    from agentrl.rollout.sampling import SamplingParams

    return SamplingParams(max_new_tokens=rollout_cfg.max_new_tokens, temperature=temperature,
                          top_k=rollout_cfg.top_k, top_p=rollout_cfg.top_p, max_context=rollout_cfg.max_context,
                          max_observation_tokens=rollout_cfg.max_observation_tokens,
                          share_prefix=rollout_cfg.share_prefix, compact=rollout_cfg.compact)
