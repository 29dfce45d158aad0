"""Build the tiny random stand-ins for the Hub models TRL 0.11.4's tests/test_ppo_trainer.py loads.

    trl-internal-testing/dummy-GPT2-correct-vocab          -> OUT/dummy-GPT2-correct-vocab
    trl-internal-testing/tiny-BloomForCausalLM-correct-vocab -> OUT/tiny-BloomForCausalLM-correct-vocab
    gpt2 (test_generation*)                                -> OUT/gpt2

Not built: trl-internal-testing/tiny-T5ForConditionalGeneration-correct-vocab (agentrl has no
encoder-decoder support; run.sh removes the T5 load from setUp and deselects the t5 case).

Deterministic: fixed corpus, fixed seeds, no network. The GPT-2 tokenizer is a byte-level BPE with GPT-2's
pre-tokenizer (so "This morning I went to the " is 7 tokens, as the test asserts), wrapped in
transformers' GPT2Tokenizer; <|endoftext|> is BOS/EOS/UNK and there is no pad token (the test sets
pad = eos), as with the Hub model. The Bloom tokenizer has Bloom's special tokens (<unk> <s> </s> <pad>,
ids 0-3) and pads on the left, as BloomTokenizerFast does.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel, GPT2Tokenizer
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "This morning I went to the park and then to the store.",
    "this is a test",
    "this is another, longer test",
    "The movie was good. The movie was bad. I liked it, I did not like it.",
    "Hello world! How are you today? I am fine, thank you.",
    "A quick brown fox jumps over the lazy dog.",
    "We went to the beach this morning, and the water was cold.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024",
] * 20
VOCAB = 512


def train_bpe(special):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex split
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def gpt2_tokenizer():
    tok = train_bpe(["<|endoftext|>"])
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return GPT2Tokenizer(vocab=model["vocab"], merges=merges)


def bloom_tokenizer():
    tok = train_bpe(["<unk>", "<s>", "</s>", "<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left", clean_up_tokenization_spaces=False)


def main(out):
    out = Path(out)
    gtok = gpt2_tokenizer()
    ids = gtok.encode("This morning I went to the ")
    assert len(ids) == 7, (ids, gtok.convert_ids_to_tokens(ids))
    eos = gtok.eos_token_id
    # pad_token_id = eos in the config: test_peft_model_ppo_adapter_rm_trainer runs a GPT2ForSequenceClassification
    # on a batch of 2 straight from this config (transformers raises without a pad id; TRL's CI passes it).
    # The "gpt2" stand-in uses initializer_range=0.1: at GPT-2's 0.02 a random tiny model with tied embeddings
    # just echoes the last token, which negating the (tied) lm_head does not change, so
    # test_generation_with_ref_model's "ref generations differ" could not hold for any implementation
    # (checked with plain transformers generate). The real gpt2 is a trained model where it does.
    for name, seed, init in (("dummy-GPT2-correct-vocab", 0, 0.02), ("gpt2", 1, 0.1)):
        torch.manual_seed(seed)
        cfg = GPT2Config(vocab_size=len(gtok), n_embd=32, n_layer=2, n_head=4, n_positions=256,
                         initializer_range=init, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
        GPT2LMHeadModel(cfg).save_pretrained(out / name)
        gtok.save_pretrained(out / name)

    btok = bloom_tokenizer()
    torch.manual_seed(2)
    cfg = BloomConfig(vocab_size=len(btok), hidden_size=32, n_layer=2, n_head=4,
                      bos_token_id=btok.bos_token_id, eos_token_id=btok.eos_token_id, pad_token_id=btok.pad_token_id)
    BloomForCausalLM(cfg).save_pretrained(out / "tiny-BloomForCausalLM-correct-vocab")
    btok.save_pretrained(out / "tiny-BloomForCausalLM-correct-vocab")
    # transformers 5 records its class as "TokenizersBackend"; name the class both 4.x and 5.x load
    cfg_path = out / "tiny-BloomForCausalLM-correct-vocab" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    print(f"built tiny models in {out}")


if __name__ == "__main__":
    main(sys.argv[1])
