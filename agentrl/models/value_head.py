"""One backbone for policy, value and reference (RLHF's four models become one).

`AutoModelForCausalLMWithValueHead` keeps TRL 0.11's name and call signature: `forward` returns
`(lm_logits, loss, value)`; `state_dict()` holds the LM's own keys plus `v_head.*` (only `v_head.*` under
PEFT), so checkpoints and state dicts move between TRL 0.11 and agentrl both ways. The value head reads
the policy's own last hidden state; the reference is the same backbone with the LoRA adapter disabled
(see `adapter_disabled`), or `create_reference_model`'s frozen copy for full fine-tuning.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"
# TRL 0.11's own value-head arguments; everything else given to from_pretrained goes to transformers.
V_HEAD_ARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
# Where the decoder layers of common architectures live (TRL 0.11's list, for num_shared_layers).
LAYER_PATTERNS = ("transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}",
                  "model.layers.{layer}")


class ValueHead(nn.Module):
    """Dropout then Linear(hidden, 1), computed in fp32. Zero init by default, so V starts at 0
    (Huang et al. 2024, "N+ implementation details"); dropout is kept for TRL parity but the trainer
    runs the model in eval mode, so it is never active."""

    def __init__(self, hidden_size: int, dropout: float = 0.1, init_std: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.summary = nn.Linear(hidden_size, 1)
        if init_std > 0:
            nn.init.normal_(self.summary.weight, std=init_std)
        else:
            nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (B, T, H) -> values (B, T), fp32."""
        return self.summary(self.dropout(hidden_states.to(self.summary.weight.dtype))).squeeze(-1)


def accepts_position_ids(lm: nn.Module) -> bool:
    """Whether the causal LM's forward takes `position_ids` (BLOOM's does not: ALiBi reads the mask)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return "position_ids" in inspect.signature(base.forward).parameters


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM (plain or `PeftModel`) plus a scalar value head on its last hidden state.

    TRL 0.11's value-head arguments are accepted here and by `from_pretrained`: `summary_dropout_prob`
    (default 0.1, or the model config's own), `v_head_init_strategy` (None: agentrl's zero init, "normal":
    N(0, `v_head_initializer_range`) weights and a zero bias), `v_head_initializer_range` (default 0.2).
    """

    supported_args = V_HEAD_ARGS
    lm_head_namings = ("lm_head", "embed_out")

    def __init__(self, pretrained_model: nn.Module, v_head_init_std: float = 0.0, v_head_dropout: float | None = None,
                 summary_dropout_prob: float | None = None, v_head_initializer_range: float = 0.2,
                 v_head_init_strategy: str | None = None, score_module: nn.Module | None = None,
                 supports_rm_adapter: bool = False, rm_adapter_name: str | None = None):
        super().__init__()
        self.pretrained_model = pretrained_model
        config = pretrained_model.config
        hidden = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        # TRL: a model config's own summary_dropout_prob wins over the argument.
        dropout = getattr(config, "summary_dropout_prob", None)
        if dropout is None:
            dropout = summary_dropout_prob if summary_dropout_prob is not None else v_head_dropout
        device = next(pretrained_model.parameters()).device
        self.v_head = ValueHead(hidden, 0.1 if dropout is None else dropout, v_head_init_std).to(
            device=device, dtype=torch.float32)
        if v_head_init_strategy == "normal":
            with torch.no_grad():
                self.v_head.summary.weight.normal_(mean=0.0, std=v_head_initializer_range)
                self.v_head.summary.bias.zero_()
        elif v_head_init_strategy is not None:
            raise ValueError(f"v_head_init_strategy must be None or 'normal', got {v_head_init_strategy!r}")
        self.supports_rm_adapter, self.rm_adapter_name, self.policy_adapter_name = (
            supports_rm_adapter, rm_adapter_name, "default")
        if score_module is not None:
            self.score = score_module
        self.is_loaded_in_8bit = getattr(pretrained_model, "is_loaded_in_8bit", False)
        self.is_loaded_in_4bit = getattr(pretrained_model, "is_loaded_in_4bit", False)
        self.is_sequential_parallel = False
        self.current_device = device
        self._position_ids = accepts_position_ids(pretrained_model)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, peft_config=None, v_head_init_std: float = 0.0,
                        reward_adapter: str | None = None, reward_adapter_name: str = "reward_adapter",
                        is_trainable: bool = False, **kwargs) -> "AutoModelForCausalLMWithValueHead":
        """Load (or wrap) a causal LM, optionally add a LoRA adapter, and load a saved value head if present.

        A directory with `adapter_config.json` is loaded as base model + that adapter. The value head comes
        from `value_head.safetensors` (agentrl) or from the `v_head.*` keys TRL 0.11 writes into
        `model.safetensors` / `pytorch_model.bin`. `reward_adapter`: a LoRA reward-model adapter directory
        (with its `score` head) loaded next to the policy adapter, for `compute_reward_score`.
        """
        from transformers import AutoModelForCausalLM

        head_kwargs = {k: kwargs.pop(k) for k in V_HEAD_ARGS if k in kwargs}
        # TRL 0.11's scripts pass load_in_8bit / load_in_4bit, which transformers 5 only takes as a quantization_config.
        bits = {k: kwargs.pop(k) for k in ("load_in_8bit", "load_in_4bit") if k in kwargs}
        if any(bits.values()):
            from transformers import BitsAndBytesConfig

            kwargs.setdefault("quantization_config", BitsAndBytesConfig(**bits))
        source = pretrained_model_name_or_path
        if isinstance(source, nn.Module):
            model = source
        elif isinstance(source, (str, os.PathLike)):
            adapter = Path(source) / "adapter_config.json"
            if adapter.exists():
                from peft import PeftConfig, PeftModel

                base = PeftConfig.from_pretrained(str(source)).base_model_name_or_path
                model = AutoModelForCausalLM.from_pretrained(base, *model_args, **kwargs)
                model = PeftModel.from_pretrained(model, str(source), is_trainable=is_trainable)
                if peft_config is not None:
                    logging.warning("peft_config ignored: %s already holds a trained adapter", source)
                    peft_config = None
            else:
                model = AutoModelForCausalLM.from_pretrained(source, *model_args, **kwargs)
        else:
            raise ValueError(f"pretrained_model_name_or_path should be a path, a model id or a model, "
                             f"got {type(source).__name__}")
        if peft_config is not None and not hasattr(model, "peft_config"):
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        rm_args = {}
        if reward_adapter is not None:
            if not hasattr(model, "peft_config"):
                raise ValueError("reward_adapter can only be used with a PeftModel")
            rm_args = {"score_module": _load_reward_adapter(model, str(reward_adapter), reward_adapter_name),
                       "supports_rm_adapter": True, "rm_adapter_name": reward_adapter_name}
        wrapped = cls(model, v_head_init_std=v_head_init_std, **head_kwargs, **rm_args)
        if not isinstance(source, nn.Module):
            state = _saved_v_head(Path(str(source)))
            if state:
                wrapped.v_head.load_state_dict(state)
        return wrapped

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "disable_adapter") and hasattr(self.pretrained_model, "peft_config")

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False,
                **kwargs):
        """Returns `(lm_logits (B, T, V) fp32, loss, value (B, T))`, as TRL 0.11 did (plus the cache when
        `return_past_key_values`)."""
        if not self._position_ids:
            kwargs.pop("position_ids", None)
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                    **kwargs)
        value = self.v_head(out.hidden_states[-1].to(self.v_head.summary.weight.device))
        logits = out.logits if out.logits.dtype == torch.float32 else out.logits.float()
        if return_past_key_values:
            return logits, getattr(out, "loss", None), value, out.past_key_values
        return logits, getattr(out, "loss", None), value

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    # TRL 0.11 forwards these methods of the wrapped LM.
    def gradient_checkpointing_enable(self, *args, **kwargs):
        return self.pretrained_model.gradient_checkpointing_enable(*args, **kwargs)

    def gradient_checkpointing_disable(self, *args, **kwargs):
        return self.pretrained_model.gradient_checkpointing_disable(*args, **kwargs)

    def enable_input_require_grads(self, *args, **kwargs):
        return self.pretrained_model.enable_input_require_grads(*args, **kwargs)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.pretrained_model.prepare_inputs_for_generation(*args, **kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """TRL 0.11's layout: the LM's own keys (none under PEFT: the adapter is saved by PEFT) plus `v_head.*`."""
        if args:  # torch's deprecated positional form state_dict(destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        out = {} if destination is None else destination
        if not self.is_peft_model:
            self.pretrained_model.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        self.v_head.state_dict(destination=out, prefix=prefix + "v_head.", keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads TRL 0.11's layout (LM keys + `v_head.*`) as well as torch's own (`pretrained_model.*`)."""
        state = {k if k.startswith(("v_head.", "pretrained_model.", "score.")) else f"pretrained_model.{k}": v
                 for k, v in state_dict.items()}
        if self.is_peft_model and not any(k.startswith("pretrained_model.") for k in state):
            strict = False  # TRL's PEFT state dict holds only the value head
        return super().load_state_dict(state, strict=strict, assign=assign)

    def compute_reward_score(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """Scores (B, T, num_labels) from the reward adapter's `score` head, with the reward adapter active;
        the policy adapter is active again afterwards. Needs `from_pretrained(..., reward_adapter=...)`."""
        if not self.supports_rm_adapter:
            raise ValueError("This model does not support reward modeling adapter: load it with "
                             "AutoModelForCausalLMWithValueHead.from_pretrained(model, reward_adapter=path)")
        self.pretrained_model.set_adapter(self.rm_adapter_name)
        self.pretrained_model.eval()
        try:
            with torch.no_grad():
                out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask,
                                            output_hidden_states=True, return_dict=True, **kwargs)
                scores = self.score(out.hidden_states[-1])
        finally:
            self.pretrained_model.set_adapter(self.policy_adapter_name)
            self.pretrained_model.eval()
        return scores

    def push_to_hub(self, *args, **kwargs):
        raise NotImplementedError("push_to_hub is not supported; save_pretrained and upload the directory")

    @contextlib.contextmanager
    def adapter_disabled(self):
        """The reference policy: the same weights with the LoRA adapter switched off."""
        if not self.is_peft_model:
            raise ValueError("adapter_disabled() needs a PEFT model; full fine-tuning keeps a frozen reference copy")
        with self.pretrained_model.disable_adapter():
            yield

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """The LM as `save_pretrained` writes it (a PEFT adapter under LoRA) plus `value_head.safetensors`.

        A full model's `model.safetensors` also carries the `v_head.*` keys, where TRL 0.11 looks for them.
        """
        state = {f"v_head.{k}": v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}
        if not self.is_peft_model and "state_dict" not in kwargs:
            kwargs["state_dict"] = {**self.pretrained_model.state_dict(), **state}
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        save_file(state, str(Path(save_directory) / VALUE_HEAD_FILE))


class AutoModelForSeq2SeqLMWithValueHead(nn.Module):
    """TRL 0.11's encoder-decoder value-head model. agentrl trains causal LMs only: using it is an error."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_NO_SEQ2SEQ)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise NotImplementedError(_NO_SEQ2SEQ)


_NO_SEQ2SEQ = ("AutoModelForSeq2SeqLMWithValueHead: encoder-decoder models are not supported by agentrl; "
               "use a causal LM with AutoModelForCausalLMWithValueHead")


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> nn.Module:
    """A frozen (eval, no grad) copy of `model`, the reference for the KL penalty (TRL 0.11 semantics).

    num_shared_layers: the parameters before layer `num_shared_layers` (embeddings and the first layers)
    are shared with the reference instead of copied, and frozen in `model` too: they stay as they were, so
    sharing them is exact and saves their memory. `pattern` names the first unshared layer, e.g.
    "transformer.h.{layer}"; by default it is found among common architectures' layer names.
    """
    names = [n for n, _ in model.named_parameters()]
    if num_shared_layers is None:
        return copy.deepcopy(model).requires_grad_(False).eval()
    if pattern is not None:
        pattern = pattern.format(layer=num_shared_layers)
    else:
        candidates = (p.format(layer=num_shared_layers) for p in LAYER_PATTERNS)
        pattern = next((p for p in candidates if any(p in n for n in names)), None)
    if pattern is None:
        raise ValueError("Layer pattern could not be matched.")
    shared = []
    for name, param in model.named_parameters():
        if pattern in name:
            break
        shared.append(param)
    if len(shared) == len(names):
        logging.warning("Pattern passed or found, but no layers matched in the model. Check for a typo.")
    for param in shared:
        param.requires_grad_(False)
    # deepcopy's memo maps each shared parameter to itself: the copy holds the very same tensors.
    ref = copy.deepcopy(model, memo={id(p): p for p in shared})
    return ref.requires_grad_(False).eval()


def _saved_v_head(path: Path) -> dict[str, torch.Tensor]:
    """The value head saved in a checkpoint directory, by agentrl or by TRL 0.11, without the `v_head.` prefix."""
    for name in (VALUE_HEAD_FILE, "model.safetensors", "pytorch_model.bin"):
        file = path / name
        if not file.exists():
            continue
        state = load_file(str(file)) if name.endswith(".safetensors") else torch.load(
            file, map_location="cpu", weights_only=True)
        heads = {k.removeprefix("v_head."): v for k, v in state.items() if k.startswith("v_head.")}
        if heads:
            return heads
    return {}


def _load_reward_adapter(model, adapter_dir: str, adapter_name: str) -> nn.Module:
    """Load a LoRA reward-model adapter next to the policy's and return its frozen `score` head (TRL 0.11)."""
    model.load_adapter(adapter_dir, adapter_name, is_trainable=False)
    model.train()
    path = Path(adapter_dir)
    if (path / "adapter_model.safetensors").exists():
        state = load_file(str(path / "adapter_model.safetensors"))
    elif (path / "adapter_model.bin").exists():
        state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"no adapter_model.safetensors or adapter_model.bin in {adapter_dir}")
    score = {k.rsplit(".", 1)[-1]: v for k, v in state.items() if "score" in k}
    if "weight" not in score:
        raise ValueError(f"the reward adapter in {adapter_dir} has no 'score' head")
    num_labels, hidden = score["weight"].shape
    head = nn.Linear(hidden, num_labels, bias="bias" in score)
    head.load_state_dict(score)
    device = next(model.parameters()).device
    return head.to(device=device, dtype=model.dtype).requires_grad_(False)
