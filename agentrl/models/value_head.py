"""One backbone for policy, value and reference (seed 004's four models become one).

`AutoModelForCausalLMWithValueHead` keeps TRL 0.11's name and call signature: `forward` returns
`(lm_logits, loss, value)`. The value head reads the policy's own last hidden state; the reference is
the same backbone with the LoRA adapter disabled (see `reference_logits`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


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


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM (plain or `PeftModel`) plus a scalar value head on its last hidden state."""

    def __init__(self, pretrained_model: nn.Module, v_head_init_std: float = 0.0, v_head_dropout: float = 0.1):
        super().__init__()
        self.pretrained_model = pretrained_model
        hidden = pretrained_model.config.hidden_size
        device = next(pretrained_model.parameters()).device
        self.v_head = ValueHead(hidden, v_head_dropout, v_head_init_std).to(device=device, dtype=torch.float32)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, peft_config=None, v_head_init_std: float = 0.0,
                        **kwargs) -> "AutoModelForCausalLMWithValueHead":
        """Load (or wrap) a causal LM, optionally add a LoRA adapter, and load a saved value head if present."""
        from transformers import AutoModelForCausalLM

        if isinstance(pretrained_model_name_or_path, nn.Module):
            model = pretrained_model_name_or_path
        else:
            model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        wrapped = cls(model, v_head_init_std=v_head_init_std)
        if not isinstance(pretrained_model_name_or_path, nn.Module):
            head = Path(str(pretrained_model_name_or_path)) / VALUE_HEAD_FILE
            if head.exists():
                wrapped.v_head.load_state_dict({k.removeprefix("v_head."): v for k, v in load_file(head).items()})
        return wrapped

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "disable_adapter") and hasattr(self.pretrained_model, "peft_config")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        """Returns `(lm_logits (B, T, V), loss, value (B, T))`, as TRL 0.11 did."""
        kwargs.pop("return_past_key_values", None)
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    output_hidden_states=True, **kwargs)
        value = self.v_head(out.hidden_states[-1])
        return out.logits, getattr(out, "loss", None), value

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    @contextlib.contextmanager
    def adapter_disabled(self):
        """The reference policy: the same weights with the LoRA adapter switched off."""
        if not self.is_peft_model:
            raise ValueError("adapter_disabled() needs a PEFT model; full fine-tuning keeps a frozen reference copy")
        with self.pretrained_model.disable_adapter():
            yield

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """The LM as `save_pretrained` writes it (a PEFT adapter under LoRA) plus `value_head.safetensors`."""
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        state = {f"v_head.{k}": v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}
        save_file(state, str(Path(save_directory) / VALUE_HEAD_FILE))
