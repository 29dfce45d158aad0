"""The LLM judge (agentrl/judge.py): prompt, verdict parsing, retries then masking, the cache, a local judge on the
tiny model, and a real OpenAI-compatible server (`transformers serve`, slow)."""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from agentrl.judge import (JudgeError, JudgeScorer, JudgeSection, LocalJudge, check_judge, judge_messages,
                           parse_ranking, parse_rating, parse_yes_no, yes_probability)
from agentrl.rollout.engine import Episode


class CharTokenizer:
    """Ids are character codes: enough for the judge to decode a trajectory."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def episode(question, text, answer="42", prompt="P"):
    return Episode(task={"question": question, "answer": answer}, prompt_ids=[ord(c) for c in prompt],
                   token_ids=[ord(c) for c in text], loss_mask=[1] * len(text), turn_ends=[len(text) - 1],
                   turn_rewards=[1.0])


class Scripted:
    """A judge back end that answers from a list (not a server: the server test below uses a real one)."""

    name = "scripted"

    def __init__(self, outputs):
        self.outputs, self.calls = list(outputs), []

    def complete(self, messages, temperature, max_new_tokens, seed=0):
        self.calls.append((messages, temperature))
        return self.outputs.pop(0)

    def next_token(self, messages, k=20):
        self.calls.append((messages, 0.0))
        return self.outputs.pop(0)


def test_prompt_has_rubric_reference_responses_and_the_ask():
    section = JudgeSection(mode="ranking", model="m", rubric="Be right.")
    user = judge_messages(section, "What is 6*7?", ["42", "41"], "42")[1]["content"]
    for part in ("Principles:\nBe right.", "Task:\nWhat is 6*7?", "Reference answer:\n42", "Response 1:\n42",
                 "Response 2:\n41", "Ranking:"):
        assert part in user
    rating = judge_messages(JudgeSection(mode="rating", max_rating=5), "q", ["a"], None)[1]["content"]
    assert "Reference answer" not in rating and "0 (fails) to 5" in rating and "Response:\na" in rating


def test_parsers():
    assert parse_rating("Score: 7", 10) == 0.7
    assert parse_rating("**Score:** 10", 10) == 1.0
    assert parse_rating(" 3 ", 5) == 0.6
    assert parse_rating("Score: 11", 10) is None and parse_rating("great answer", 10) is None
    assert parse_ranking("Ranking: 2 > 1 > 3", 3) == [0.5, 1.0, 0.0]
    assert parse_ranking("Ranking: 2 > 2 > 3", 3) is None and parse_ranking("1 > 2", 2) is None
    assert parse_yes_no("Yes.") == 1.0 and parse_yes_no("no") == 0.0 and parse_yes_no("maybe") is None
    assert yes_probability({" Yes": 0.6, "yes": 0.1, "No": 0.1, "The": 0.2}) == pytest.approx(0.7 / 0.8)
    assert yes_probability({"The": 0.99, "yes": 0.01}) is None  # the judge meant to say something else


def test_judge_score_replaces_the_env_score():
    eps = [episode("q", "The answer is 42.")]
    JudgeScorer(JudgeSection(mode="rating", model="m"), CharTokenizer(), backend=Scripted(["Score: 8"]))(eps)
    assert eps[0].score == pytest.approx(0.8) and eps[0].info["env_score"] == 1.0 and not eps[0].infra_failure


def test_malformed_verdicts_are_retried_then_masked_and_counted():
    backend = Scripted(["no idea", "Score: 99", "Score: 4", "junk", "junk", "junk"])
    scorer = JudgeScorer(JudgeSection(mode="rating", model="m", retries=2), CharTokenizer(), backend=backend)
    eps = [episode("q1", "a"), episode("q2", "b")]
    scorer(eps)
    assert eps[0].score == pytest.approx(0.4) and not eps[0].infra_failure  # third ask read
    assert [t for _, t in backend.calls[:3]] == [0.0, 0.7, 0.7]  # greedy first, sampled retries
    assert eps[1].infra_failure and eps[1].info["judge_failure"]  # masked out, not scored 0
    assert scorer.summary()["failed"] == 1 and scorer.summary()["failure_rate"] == 0.5
    assert scorer.stats["retried"] == 4 and scorer.stats["asked"] == 6


def test_ranking_one_call_per_group():
    eps = [episode("q", "x", prompt="A"), episode("q", "y", prompt="A"), episode("r", "z", prompt="B")]
    backend = Scripted(["Ranking: 2 > 1", "Score: 10"])  # a group of one is rated
    JudgeScorer(JudgeSection(mode="ranking", model="m"), CharTokenizer(), backend=backend)(eps)
    assert [ep.score for ep in eps] == [0.0, 1.0, 1.0] and len(backend.calls) == 2


def test_yes_no_reads_probabilities_and_masks_without_retrying():
    backend = Scripted([{"Yes": 0.3, "No": 0.1}, {"Hmm": 0.9}])
    scorer = JudgeScorer(JudgeSection(mode="yes_no", model="m"), CharTokenizer(), backend=backend)
    eps = [episode("q1", "a"), episode("q2", "b")]
    scorer(eps)
    assert eps[0].score == pytest.approx(0.75) and eps[1].infra_failure and len(backend.calls) == 2


def test_cache_answers_a_resumed_run(tmp_path):
    cache = tmp_path / "judge-cache.jsonl"
    section = JudgeSection(mode="rating", model="m")
    JudgeScorer(section, CharTokenizer(), cache, backend=Scripted(["junk", "Score: 6"]))([episode("q", "a")])
    with open(cache, "a") as f:
        f.write('{"key": "torn')  # a run killed mid-write
    again = JudgeScorer(section, CharTokenizer(), cache, backend=Scripted([]))  # asks nothing: pop() would fail
    eps = [episode("q", "a")]
    again(eps)
    assert eps[0].score == pytest.approx(0.6) and again.stats["asked"] == 0 and again.stats["cached"] == 2


def test_bad_settings_name_the_key():
    with pytest.raises(JudgeError, match="reward.judge.model"):
        check_judge(JudgeSection(mode="rating"))
    with pytest.raises(JudgeError, match="reward.judge.max_rating"):
        check_judge(JudgeSection(mode="rating", model="m", max_rating=0))


def test_local_judge_on_the_tiny_model(tiny_base, tmp_path):
    """The tiny model is no judge, but the whole local path runs: next-token probabilities and generation, each
    verdict scored or masked and counted, all cached."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    judge = LocalJudge(tiny_base)
    top = judge.next_token(judge_messages(JudgeSection(mode="yes_no"), "q", ["a"], None))
    assert 0 < sum(top.values()) <= 1.0001
    for mode in ("yes_no", "rating"):
        section = JudgeSection(mode=mode, model=tiny_base, rubric="Be right.", retries=1, max_new_tokens=8)
        scorer = JudgeScorer(section, tokenizer, tmp_path / f"{mode}.jsonl", backend=judge)
        eps = [Episode(task={"question": "2+2?", "answer": "4"}, prompt_ids=tokenizer("Q")["input_ids"],
                       token_ids=tokenizer("Answer: 4")["input_ids"], turn_ends=[0], turn_rewards=[1.0])]
        scorer(eps)
        assert eps[0].infra_failure or 0 <= eps[0].score <= 1
        assert scorer.stats["episodes"] == 1 and scorer.stats["failed"] == eps[0].infra_failure
        assert (tmp_path / f"{mode}.jsonl").read_text().count("\n") == scorer.stats["asked"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_server_judge_against_a_real_transformers_serve(tiny_base, tmp_path):
    """A real OpenAI-compatible server (`transformers serve`, pip install 'transformers[serving]') serving the
    tiny model; the `openai` client asks it, verdicts are cached, and a second scorer asks nothing."""
    pytest.importorskip("openai", reason="the openai client is not installed (pip install 'agentrl[judge]')")
    pytest.importorskip("fastapi", reason="transformers serve needs pip install 'transformers[serving]'")
    cli = shutil.which("transformers", path=str(__import__("pathlib").Path(sys.executable).parent))
    if cli is None:
        pytest.skip("the transformers CLI is not installed next to this python")
    # The tiny model has no chat template, and a chat endpoint needs one: a copy with the plainest template.
    served = tmp_path / "judge-model"
    shutil.copytree(tiny_base, served)
    (served / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}Verdict: {% endif %}")
    port = _free_port()
    server = subprocess.Popen([cli, "serve", "--port", str(port), "--device", "cpu"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not come up in 120 s")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_base)
        section = JudgeSection(mode="rating", model=str(served), rubric="Be right.", base_url=f"http://127.0.0.1:{port}/v1", retries=1,
                               max_new_tokens=8, timeout=120, concurrency=2)
        eps = [Episode(task={"question": f"{k}+1?", "answer": str(k + 1)}, prompt_ids=tokenizer("Q")["input_ids"],
                       token_ids=tokenizer(f"Answer: {k + 1}")["input_ids"], turn_ends=[0], turn_rewards=[1.0])
               for k in range(2)]
        scorer = JudgeScorer(section, tokenizer, tmp_path / "cache.jsonl")
        scorer(eps)
        rows = [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]
        assert rows and all(isinstance(r["output"], str) for r in rows)  # real replies, not errors
        assert scorer.stats["episodes"] == 2 and scorer.stats["failed"] == sum(ep.infra_failure for ep in eps)
        again = JudgeScorer(section, tokenizer, tmp_path / "cache.jsonl")
        again([Episode(**{**ep.__dict__, "info": {}, "turn_rewards": [1.0]}) for ep in eps])
        assert again.stats["asked"] == 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_judged_pairs_leave_out_masked_episodes():
    """Iterative DPO / `agentrl preferences`: a judge's ranking picks chosen and rejected; an episode it could not
    judge takes no part (rows keep the {prompt, chosen, rejected} format the reward-model job reads)."""
    from agentrl.preferences import build_pairs

    eps = [episode("q", t, prompt="A") for t in ("x", "y", "z")] + [episode("r", t, prompt="B") for t in ("u", "v")]
    backend = Scripted(["Ranking: 3 > 1 > 2", "junk", "junk"])
    JudgeScorer(JudgeSection(mode="ranking", model="m", retries=1), CharTokenizer(), backend=backend)(eps)
    pairs, _ = build_pairs(eps[:3], 3)
    assert [(chr(b.token_ids[0]), chr(w.token_ids[0])) for b, w in pairs] == [("z", "y")]
    assert all(ep.infra_failure for ep in eps[3:]) and build_pairs(eps[3:], 2) == ([], 1)
