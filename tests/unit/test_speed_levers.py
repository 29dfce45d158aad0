"""The speed levers keep the maths: each fast path against the plain full forward, values and gradients."""

import copy
import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import agentrl.trainers.common as common
from agentrl.algos.losses import entropy_from_logits
from agentrl.trainers.common import (build_batch, common_prefix_logprobs, lm_logprobs, masked_logprobs, policy_forward,
                                     response_logprobs, shared_prefix_logprobs)


rest_logprobs = common._rest_logprobs


def tiny_lora(vocab: int = 97, seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, pad_token_id=0))
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, lora).eval()


P1, P2 = [1, 5, 6, 7], [1, 9]
# Two groups sharing prompts (P1 x 3, P2 x 2), a tool-output token (mask 0) inside the first row, ragged lengths.
ROWS = [(P1 + [8, 9, 10, 3], [0] * 4 + [1, 1, 0, 1], []), (P1 + [20, 21], [0] * 4 + [1, 1], []),
        (P2 + [30, 31, 32, 33, 34], [0, 0, 1, 1, 1, 1, 1], []), (P2 + [40], [0, 0, 1], []),
        (P1 + [8, 2], [0] * 4 + [1, 1], [])]


def reference(model, batch, temperature):
    """The plain path: full (B, T, V) logits, masked afterwards."""
    logprobs, logits = lm_logprobs(model, batch, temperature, return_logits=True)
    entropy = entropy_from_logits(logits[:, :-1].float() / temperature)
    return logprobs * batch.loss_mask, entropy * batch.loss_mask


def values_and_grads(model, fn):
    model.zero_grad()
    logprobs, entropy = fn()
    (0.3 * logprobs.sum() + entropy.sum()).backward()
    return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_same(a, b, atol=2e-6):
    assert torch.allclose(a[0], b[0], atol=atol) and torch.allclose(a[1], b[1], atol=atol)
    assert all(torch.allclose(x, y, atol=atol) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("chunk,block_logits,recompute_above", [(1024, 1 << 25, 1 << 25), (3, 1 << 25, 0),
                                                               (1024, 2 * 97, 1 << 25)])
def test_response_only_logprobs_match_the_full_forward(monkeypatch, chunk, block_logits, recompute_above):
    """Head only at sampled positions, in chunks (of LOGPROB_CHUNK positions or fewer where LOGPROB_BLOCK_LOGITS
    bounds them: 2 positions at V = 97), with the head recomputed in backward: same numbers and grads."""
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
    monkeypatch.setattr(common, "LOGPROB_BLOCK_LOGITS", block_logits)
    monkeypatch.setattr(common, "RECOMPUTE_HEAD_ABOVE", recompute_above)
    model, batch = tiny_lora(), build_batch(ROWS, 0)
    fast = values_and_grads(model, lambda: response_logprobs(model, batch, 0.7, with_entropy=True,
                                                             entropy_grad=True)[:2])
    assert_same(fast, values_and_grads(model, lambda: reference(model, batch, 0.7)))


@pytest.mark.parametrize("grouped", [False, True])
def test_shared_prefix_logprobs_match_the_full_forward(monkeypatch, grouped):
    """Each distinct prompt runs once and its KV cache is shared: same logprobs, entropy and gradients; also with
    the rests run in two groups by length (rests of 1, 2, 2 and 4, 5 tokens: 16 padded positions instead of 25)."""
    calls = []
    monkeypatch.setattr(common, "_rest_logprobs", lambda *a, **k: calls.append(len(a[4])) or rest_logprobs(*a, **k))
    model, batch = tiny_lora(), build_batch(ROWS, 0)
    shared = values_and_grads(model, lambda: shared_prefix_logprobs(model, batch, 0.7, with_entropy=True,
                                                                    entropy_grad=True,
                                                                    rest_min_saving=0.3 if grouped else 1.1)[:2])
    assert_same(shared, values_and_grads(model, lambda: reference(model, batch, 0.7)))
    assert calls == ([3, 2] if grouped else [5])  # rows per forward of the rests
    # Nothing to share (every prompt distinct): no shortcut taken.
    assert shared_prefix_logprobs(model, build_batch(ROWS[1:3], 0), 0.7) is None


# Agent episodes: one system prompt (S), distinct questions, then sampled turns (a tool output, mask 0, inside one).
S = [1, 5, 6, 7, 11, 12]
AGENT_ROWS = [(S + [20, 21] + [8, 9, 10, 3], [0] * 8 + [1, 1, 0, 1], []), (S + [22] + [30, 31], [0] * 7 + [1, 1], []),
              (S + [23, 24, 25] + [40, 41, 42, 43], [0] * 9 + [1, 1, 1, 1], []), (S + [20, 26] + [50], [0] * 8 + [1], [])]


@pytest.mark.parametrize("buckets,saving,calls", [(None, None, [4]), (2, 0.2, [2, 2]), (3, 0.2, [2, 2]),
                                                  (3, 0.01, [2, 1, 1])])
def test_common_prefix_logprobs_match_the_full_forward(monkeypatch, buckets, saving, calls):
    """The prompt's common prefix runs once for the whole batch: same logprobs, entropy, values and gradients;
    also with the rests run in groups by length (rests of 3, 3, 6, 7 tokens: 28 padded positions in one forward,
    20 in two groups, 19 in three: a third group saves 5%, taken only when asked to save less)."""
    from agentrl.models.value_head import AutoModelForCausalLMWithValueHead

    rows_per_forward = []
    monkeypatch.setattr(common, "_rest_logprobs",
                        lambda *a, **k: rows_per_forward.append(len(a[4])) or rest_logprobs(*a, **k))
    model = AutoModelForCausalLMWithValueHead(tiny_lora(), v_head_init_std=0.1).eval()
    lm, batch = model.pretrained_model, build_batch(AGENT_ROWS, 0)

    def run(fn):
        model.zero_grad()
        logprobs, entropy, values = fn()
        (0.3 * logprobs.sum() + entropy.sum() + 0.5 * values.sum()).backward()
        return [x.detach() for x in (logprobs, entropy, values)], [p.grad.clone() for p in model.parameters()
                                                                     if p.requires_grad and p.grad is not None]

    shared = run(lambda: common_prefix_logprobs(lm, batch, 0.7, with_entropy=True, entropy_grad=True,
                                                value_head=model.v_head, min_saving=0.1,
                                                rest_min_saving=saving, rest_buckets=buckets or 2))
    assert rows_per_forward == calls
    plain = run(lambda: response_logprobs(lm, batch, 0.7, with_entropy=True, entropy_grad=True,
                                          value_head=model.v_head))
    assert all(torch.allclose(a, b, atol=2e-6) for a, b in zip(shared[0], plain[0]))
    assert len(shared[1]) == len(plain[1]) and all(torch.allclose(a, b, atol=2e-6) for a, b in zip(shared[1], plain[1]))
    assert torch.allclose(shared[0][0], reference(lm, batch, 0.7)[0], atol=2e-6)
    # Too little in common (3 rows x 6 shared tokens: 18 of 43 positions, < 50%): no shortcut.
    assert common_prefix_logprobs(lm, batch, 0.7, min_saving=0.5) is None


@pytest.mark.parametrize("lengths,most,runs", [
    ([3, 3, 6, 7], 2, [(0, 2), (2, 4)]),
    ([3, 3, 6, 7], 3, [(0, 2), (2, 3), (3, 4)]),
    ([11, 12, 12, 13, 15, 50, 100, 144], 3, [(0, 5), (5, 6), (6, 8)]),  # many short episodes, a few long:
    ([11, 12, 12, 13, 15, 50, 100, 144], 2, [(0, 5), (5, 8)]),  # 413 and 507 padded positions, against 1152
    ([5, 5, 5], 3, [(0, 3)]),  # equal lengths: one run (fewer runs on a tie)
    ([4], 2, [(0, 1)]),
])
def test_fewest_padded_runs_cuts_where_padding_is_least(lengths, most, runs):
    assert common.fewest_padded_runs(lengths, most) == runs


def test_fewest_padded_runs_takes_another_run_only_when_it_saves_enough():
    lengths = [11, 12, 12, 13, 15, 50, 100, 144]  # 1152 padded positions in one run, 507 in two, 413 in three
    assert common.fewest_padded_runs(lengths, 3, min_gain=0.1) == [(0, 5), (5, 6), (6, 8)]  # 413 < 0.9 x 507
    assert common.fewest_padded_runs(lengths, 3, min_gain=0.2) == [(0, 5), (5, 8)]  # 413 > 0.8 x 507
    assert common.fewest_padded_runs(lengths, 3, min_gain=0.6) == [(0, 8)]  # 507 > 0.4 x 1152


def test_masked_logprobs_falls_back_when_the_head_cannot_be_split(monkeypatch):
    model, batch = tiny_lora(), build_batch(ROWS, 0)
    monkeypatch.setattr(model.get_base_model().config, "final_logit_softcapping", None, raising=False)
    soft = copy.deepcopy(model)
    head = soft.get_base_model().lm_head
    soft.get_base_model().lm_head = torch.nn.Sequential(head)  # logits are no longer a plain Linear of the hidden
    logprobs, _ = masked_logprobs(soft, batch, 1.0)
    assert torch.allclose(logprobs, reference(model, batch, 1.0)[0], atol=2e-6)


def test_value_head_values_from_the_fast_forward():
    from agentrl.models.value_head import AutoModelForCausalLMWithValueHead

    model = AutoModelForCausalLMWithValueHead(tiny_lora(), v_head_init_std=0.1).eval()
    batch = build_batch(ROWS, 0)
    logprobs, values, _, _ = policy_forward(model, batch, 1.0)
    fast = response_logprobs(model.pretrained_model, batch, 1.0, value_head=model.v_head)
    assert torch.allclose(fast[0], logprobs * batch.loss_mask, atol=2e-6)
    assert torch.allclose(fast[2], values * batch.loss_mask, atol=2e-6)


def ppo_step(tiny_base, reuse: bool, corrupt: float = 0.0, share_prompt_prefix: bool | None = None):
    """One PPO step on fixed queries and responses; with `reuse`, step() finds generate()'s logprobs/values.
    share_prompt_prefix True / False: queries behind a long common system prompt, with / without the shortcut."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl import PPOConfig, PPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-2,
                                   reuse_rollout_logprobs=reuse, value_head_init_std=0.1,
                                   share_prompt_prefix=bool(share_prompt_prefix)), model, None, tok)
    system = "Question: " if share_prompt_prefix is None else "You can call a calculator. " * 8 + "Question: "
    queries = [tok(f"{system}What is {i} + 1{i}?\n", return_tensors="pt")["input_ids"][0] for i in range(4)]
    torch.manual_seed(1)
    responses = trainer.generate(queries, return_prompt=False, max_new_tokens=6)
    for key, (logprobs, values) in trainer._generated.items():
        logprobs[:] = [x + corrupt for x in logprobs]
    torch.manual_seed(2)
    stats = trainer.step(queries, responses, [1.0, 0.0, -1.0, 0.5])
    return stats, [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]


@pytest.mark.slow
def test_ppo_reusing_the_samplers_logprobs_and_values_gives_the_same_step(tiny_base):
    """Old logprobs and values kept from the sampler (no old forward) give the update of the old forward,
    within float noise; a sampler that disagrees (here by 0.01 nats a token) falls back to the forward exactly."""
    reused, reused_params = ppo_step(tiny_base, reuse=True)
    plain, plain_params = ppo_step(tiny_base, reuse=False)
    assert reused["rollout/logprob_mismatch_mean"] < 1e-5  # checked on the first mini-batch, before any update
    for key in ("ppo/loss/total", "ppo/loss/value", "objective/kl", "ppo/val/vpred", "ppo/policy/approxkl"):
        assert reused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(reused_params, plain_params))
    fallback, fallback_params = ppo_step(tiny_base, reuse=True, corrupt=0.01)
    assert fallback["rollout/logprob_mismatch_mean"] == pytest.approx(0.01, rel=1e-3)  # the full batch's check
    assert fallback["ppo/loss/total"] == plain["ppo/loss/total"]
    assert all(torch.equal(a, b) for a, b in zip(fallback_params, plain_params))


@pytest.mark.slow
def test_ppo_sharing_the_prompt_prefix_gives_the_same_step(tiny_base, monkeypatch):
    """share_prompt_prefix: the episodes' common prompt prefix runs once per forward; the step's numbers and
    updated weights are those of the per-row forward, within float noise."""
    calls = []
    real = common.common_prefix_logprobs
    import agentrl.trainers.ppo as ppo

    monkeypatch.setattr(ppo, "common_prefix_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared, shared_params = ppo_step(tiny_base, reuse=False, share_prompt_prefix=True)
    assert calls  # the shortcut ran (old, reference and the epochs' forwards)
    plain, plain_params = ppo_step(tiny_base, reuse=False, share_prompt_prefix=False)
    for key in ("ppo/loss/total", "ppo/loss/value", "objective/kl", "ppo/val/vpred", "ppo/policy/approxkl"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(shared_params, plain_params))


def test_a_batch_of_slow_tool_calls_overlaps():
    """ToolEnv episodes of one turn are stepped from threads: 8 calls of a 0.3 s tool take far less than 2.4 s,
    and each episode gets its own result, in order."""
    import time

    from agentrl.envs import ToolEnv
    from agentrl.rollout.engine import _step_all

    def lookup(key: str) -> str:
        """Look a key up slowly.

        Args:
            key: the key
        """
        time.sleep(0.3)
        return key.upper()

    envs = [ToolEnv([lookup], check=lambda task, answer: True) for _ in range(8)]
    for i, env in enumerate(envs):
        env.reset({"question": f"q{i}", "answer": ""})
    started = time.perf_counter()
    results = _step_all(envs, [f'Action: lookup("k{i}")\n' for i in range(8)])
    assert time.perf_counter() - started < 1.2
    assert [r.observation.strip() for r in results] == [f"Observation: K{i}" for i in range(8)]


def assert_full_forward_agrees(model, contexts, samples, temperature):
    """The logprobs and values the sampler kept are those of one forward of the value-head model over each row."""
    batch = build_batch([(c + s.ids, [0] * len(c) + [1] * len(s.ids), []) for c, s in zip(contexts, samples)], 0)
    logprobs, values, _, _ = policy_forward(model, batch, temperature)
    for i, (c, s) in enumerate(zip(contexts, samples)):
        span = slice(len(c) - 1, len(c) - 1 + len(s.ids))
        assert torch.allclose(logprobs[i, span], torch.tensor(s.logprobs), atol=1e-5)
        assert torch.allclose(values[i, span], torch.tensor(s.values), atol=1e-5)


def test_sampler_shares_identical_prompts_and_reads_values():
    """Copies of a prompt are prefilled once (GRPO groups); the logprobs and values kept by the sampler are
    those a full forward of the value-head model computes on the sampled ids."""
    from agentrl.models.value_head import AutoModelForCausalLMWithValueHead
    from agentrl.rollout import SamplingParams, sample_batch

    model = AutoModelForCausalLMWithValueHead(tiny_lora(), v_head_init_std=0.1).eval()
    contexts = [P1, P1, [1, 9, 4], P1, [1, 9, 4]]
    samples = sample_batch(model.pretrained_model, contexts, SamplingParams(max_new_tokens=5, temperature=0.8), 2, 0,
                           generator=torch.Generator().manual_seed(0), value_head=model.v_head)
    assert_full_forward_agrees(model, contexts, samples, 0.8)


def test_sampler_prefills_a_common_prompt_prefix_once():
    """share_prefix: the 20 tokens every prompt begins with run once, as a cache the rest of each row continues
    (rows of other lengths padded between the two, copies of a prompt still prefilled once); the sampled ids,
    logprobs and values are those of a full forward, and greedy decoding picks what the plain prefill picks."""
    from agentrl.models.value_head import AutoModelForCausalLMWithValueHead
    from agentrl.rollout import SamplingParams, sample_batch

    model = AutoModelForCausalLMWithValueHead(tiny_lora(), v_head_init_std=0.1).eval()
    prefix = [1] + [(7 * k) % 90 + 5 for k in range(19)]
    contexts = [prefix + [11, 12, 13], prefix + [40], prefix + [11, 12, 13], prefix + [50, 51, 52, 53, 54, 55]]
    fed = []
    hook = model.pretrained_model.get_input_embeddings().register_forward_pre_hook(lambda m, a: fed.append(a[0].shape))
    runs = {}
    for share, sample in ((True, True), (True, False), (False, False)):
        fed.clear()
        runs[share, sample] = sample_batch(
            model.pretrained_model, contexts, SamplingParams(max_new_tokens=5, temperature=0.8, do_sample=sample,
                                                             share_prefix=share),
            2, 0, generator=torch.Generator().manual_seed(0), value_head=model.v_head)
        if share and sample:
            assert fed[:2] == [(1, 20), (3, 6)]  # the prefix once, then the 3 distinct rests, left-padded to 6
    hook.remove()
    assert [s.ids for s in runs[True, False]] == [s.ids for s in runs[False, False]]
    samples = runs[True, True]
    assert_full_forward_agrees(model, contexts, samples, 0.8)


@pytest.mark.parametrize("reuse_kv,share_prefix", [(True, False), (False, False), (True, True), (False, True)])
def test_multi_turn_rollout_on_the_kv_cache_keeps_exact_logprobs(tiny_base, monkeypatch, reuse_kv, share_prefix):
    """Later turns run on the cache of the earlier ones (holes where rows waited, observations appended; with
    share_prefix the first turn's cache is the prompts' common prefix, then each rest): the sampler's logprobs
    are still those of one forward over the whole episode."""
    import agentrl.rollout.sampling as sampling
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs import CalculatorEnv, calculator_tasks
    from agentrl.rollout import SamplingParams, rollout
    from agentrl.trainers.common import episodes_to_batch

    class ForcedCall(CalculatorEnv):  # a tool call in the first turn of every other episode
        def step(self, action):
            if self.turns == 0 and int(self.task["answer"]) % 2:
                action = "Action: calculator(2 + 3)\n"
            return super().step(action)

    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    monkeypatch.setattr(sampling, "MIN_SHARED_PREFIX", 2)  # the calculator prompts share "Question: What is"
    tasks = calculator_tasks(8, seed=1, split="eval")
    assert sampling.shared_prefix_length([tok(ForcedCall().reset(t))["input_ids"] for t in tasks]) >= 2
    episodes = rollout(model, tok, ForcedCall, tasks, SamplingParams(max_new_tokens=10, reuse_kv=reuse_kv,
                                                                     share_prefix=share_prefix),
                       generator=torch.Generator().manual_seed(0))
    assert any(ep.num_turns > 1 for ep in episodes)
    batch = episodes_to_batch(episodes, tok.pad_token_id)
    recomputed = lm_logprobs(model, batch, 1.0)
    assert ((recomputed - batch.logprobs).abs() * batch.loss_mask).max() < 1e-4


def test_length_buckets_give_the_one_forward_numbers_and_gradients(monkeypatch):
    model = tiny_lora()
    rows = ROWS + [([1] + list(range(10, 40)), [0] + [1] * 30, [])]  # one long row: most positions are padding
    batch = build_batch(rows, 0)
    split = values_and_grads(model, lambda: common.by_length(
        lambda b: response_logprobs(model, b, 0.7, with_entropy=True, entropy_grad=True)[:2], batch,
        min_saving=0.0))
    assert_same(split, values_and_grads(model, lambda: reference(model, batch, 0.7)))


class IntKeepOnly(LlamaForCausalLM):
    """A causal LM whose `logits_to_keep` must be an int (as some remote-code models write it)."""

    @functools.wraps(LlamaForCausalLM.forward)  # the same signature: position_ids, logits_to_keep, ...
    def forward(self, *args, **kwargs):
        if not isinstance(kwargs.get("logits_to_keep", 0), int):
            raise TypeError("logits_to_keep must be an int")
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("int_only", [False, True])
def test_the_models_own_head_runs_on_no_position_in_the_fast_paths(monkeypatch, int_only):
    """The fast paths read hidden states, so the model's own head must not run (at V = 152 K it cost a quarter of
    a DPO step): an empty position index where the model takes one; logits_to_keep=1 where it takes only an int.
    Same numbers either way; the sampler still gets its last-position logits."""
    from agentrl.rollout import SamplingParams, sample_batch
    from agentrl.rollout.sampling import index_logits_to_keep

    model = tiny_lora()
    if int_only:
        base = model.get_base_model()
        base.__class__ = IntKeepOnly
    rows_through_head = []
    model.get_base_model().lm_head.register_forward_hook(
        lambda mod, inp, out: rows_through_head.append(inp[0].shape[:-1].numel()))
    assert index_logits_to_keep(model, torch.device("cpu")) is not int_only
    batch = build_batch(ROWS, 0)
    response_logprobs(model, batch, 0.7)  # the one-time check that the head can be split off runs the head
    rows_through_head.clear()
    fast = response_logprobs(model, batch, 0.7)[0]
    shared = shared_prefix_logprobs(model, batch, 0.7, rest_min_saving=1.1)[0]  # the rests in one forward
    # The fast paths apply the head weight themselves, not through the module, so only the model's own head
    # shows here: on no position with an index; with the int, one a row (5 rows; 2 prompts, then 5 rests).
    assert rows_through_head == ([0, 0, 0] if not int_only else [5, 2, 5])
    expected = reference(model, batch, 0.7)[0]
    assert torch.allclose(fast, expected, atol=2e-6) and torch.allclose(shared, expected, atol=2e-6)
    samples = sample_batch(model, [P1, P2], SamplingParams(max_new_tokens=3), 2, 0,
                           generator=torch.Generator().manual_seed(0))
    sampled = build_batch([(c + s.ids, [0] * len(c) + [1] * len(s.ids), []) for c, s in zip([P1, P2], samples)], 0)
    for i, s in enumerate(samples):
        span = slice(len([P1, P2][i]) - 1, len([P1, P2][i]) - 1 + len(s.ids))
        assert torch.allclose(reference(model, sampled, 1.0)[0][i, span], torch.tensor(s.logprobs), atol=1e-5)



def test_sampling_builds_no_autograd_graph():
    """sample_batch runs without autograd even for a model whose weights require grad (LoRA): a rollout that kept
    every step's activations for a backward that never comes grew to 18 GB at SmolLM2-135M."""
    from agentrl.rollout.sampling import KVState, SamplingParams, sample_batch

    model = tiny_lora()
    assert any(p.requires_grad for p in model.parameters())
    kv = KVState()
    samples = sample_batch(model, [P1, P2], SamplingParams(max_new_tokens=4), eos_token_id=3, pad_token_id=0, kv=kv)
    assert len(samples) == 2 and kv.cache is not None
    values = kv.cache.layers[0].values  # v_proj carries a LoRA adapter
    assert values.grad_fn is None and not values.requires_grad
