"""Bad files and machines a user can hand agentrl, each one line naming what is wrong: non-UTF-8 data, a pairs
path with a typo, a tokenizer without EOS, a model whose vocabulary is smaller than its tokenizer, truncated
weights, fp16 on a machine without a GPU."""

import shutil

import pytest
import torch

from agentrl.data import jsonl_rows, read_jsonl
from agentrl.errors import UserError
from agentrl.jobs.evaluate import load_policy
from agentrl.preferences import PreferenceDataError, read_preference_rows


def test_non_utf8_jsonl_names_the_line(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n\xef\xbb\xbf{"c": 3}\n')
    with pytest.raises(UserError, match=r"demos\.jsonl:2: not UTF-8 text \(byte 11 of the line is b'\\xe9'\)"):
        read_jsonl(path)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"b": "x\xe2\x80\xa8y"}\n')  # a BOM, and U+2028 inside a string
    assert [row for _, row in jsonl_rows(bom)] == [{"a": 1}, {"b": "x\u2028y"}]


def test_a_pairs_path_with_a_typo_is_not_a_hub_lookup(tmp_path):
    with pytest.raises(PreferenceDataError, match=r"runs/pairs\.jsnol: no such file$"):
        read_preference_rows(str(tmp_path / "runs" / "pairs.jsnol"))


def copy_model(tiny_base, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_base, out)
    return out


def test_tokenizer_without_eos(tiny_base, tmp_path):
    from transformers import AutoTokenizer

    out = copy_model(tiny_base, tmp_path)
    tok = AutoTokenizer.from_pretrained(out)
    tok.eos_token = None
    tok.save_pretrained(out)
    with pytest.raises(UserError, match="its tokenizer has no EOS token"):
        load_policy(str(out))


def test_vocabulary_smaller_than_the_tokenizer(tiny_base, tmp_path):
    from transformers import AutoModelForCausalLM

    out = copy_model(tiny_base, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.resize_token_embeddings(model.get_input_embeddings().num_embeddings - 10)
    model.save_pretrained(out)
    with pytest.raises(UserError, match=r"vocabulary \(\d+ embeddings\) is smaller than its tokenizer's"):
        load_policy(str(out))


def test_truncated_weights(tiny_base, tmp_path):
    out = copy_model(tiny_base, tmp_path)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match="cannot load a model and its tokenizer"):
        load_policy(str(out))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where there is a CUDA GPU")
def test_fp16_without_a_gpu_is_one_line():
    from agentrl.distributed import make_accelerator

    with pytest.raises(UserError, match="mixed_precision: fp16 needs a CUDA GPU and this machine has none"):
        make_accelerator(mixed_precision="fp16")
