"""The embedded default model: a tiny Llama and a byte-level BPE tokenizer trained on demonstrations.

Nothing can be downloaded at run time, so agentrl builds its own base model in about a minute on a
laptop CPU (jobs/base_model.py). It is saved with `save_pretrained`, so every other part of agentrl
loads it exactly as it would load a real checkpoint (`AutoModelForCausalLM.from_pretrained(dir)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


@dataclass
class BaseModelConfig:
    """How the embedded base model is built. The defaults are the smallest that learned reliably here."""

    corpus: str = "calculator"  # which built-in demonstrations to learn (agentrl.envs.CORPORA)
    tool_fraction: float = 0.4  # share of demonstrations that do the job right (call the tool / every call)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    steps: int = 600  # SFT of a corpus model (a model of env.demonstrations trains with the `sft` section)
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    vocab_size: int = 512  # an upper bound: BPE on these traces stops near 315 tokens
    seed: int = 0

    def __post_init__(self):
        # RANGES cannot say this by name: a job's `steps` may be 0 (evaluate only), a builder's may not.
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.tool_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"tool_fraction: must be in [0, 1], got {self.tool_fraction}")
        from agentrl.envs import CORPORA

        if self.corpus not in CORPORA:
            raise ValueError(f"corpus: {self.corpus!r} is not one of the built-in corpora ({', '.join(CORPORA)})")


MAX_TOKENIZER_TEXT = 4096  # characters of one text that the tokenizer is trained on


def build_tokenizer(texts: list[str], vocab_size: int, extra_special: tuple[str, ...] = (),
                    chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE with every digit its own token (so numbers copy digit by digit), BOS/EOS/PAD distinct."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    # BPE training time grows with the square of a word's length: one 2 MB row of a user's data would take
    # hours. Demonstrations are a few hundred characters; the cap only ever touches rows no demonstration has.
    tok.train_from_iterator((text[:MAX_TOKENIZER_TEXT] for text in texts), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        clean_up_tokenization_spaces=False, additional_special_tokens=list(extra_special) or None,
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_llama(config: BaseModelConfig, tokenizer) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama for this tokenizer (tied embeddings, no dropout); seed torch first."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attention_dropout=0.0,
    ))
