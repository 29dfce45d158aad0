"""The run report: samples.jsonl from real training steps, report.html parsed and rendered in a real browser,
and the trackers (TensorBoard, W&B offline) read back with their own readers."""

import json
import struct
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from agentrl.cli import main
from agentrl.samples import episode_record, read_jsonl, token_pieces

TINY = ["ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.ppo_epochs=1", "env.train_tasks=64", "env.eval_tasks=8",
        "rollout.max_new_tokens=16", "progress=false"]


@pytest.fixture(scope="module")
def ppo_run(tiny_base, tmp_path_factory):
    """Three PPO steps with episodes sampled at steps 1 and 2, and TensorBoard on."""
    out = tmp_path_factory.mktemp("report") / "run"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", f"out_dir={out}", "steps=3",
                 "sample_every=2", "samples_per_step=3", "ppo.log_with=tensorboard", *TINY]) == 0
    return out


class Page(HTMLParser):
    """Every tag with its attributes, and the text."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def classes(page, tag):
    return [set(a.get("class", "").split()) for t, a in page.tags if t == tag]


def test_samples_hold_aligned_token_level_episodes(ppo_run, tiny_base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    rows = read_jsonl(ppo_run / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]  # step 1 and every sample_every=2 steps
    for r in rows:
        n = len(r["token_ids"])
        for col in ("pieces", "roles", "loss_mask", "logprobs", "trainer_logprobs", "ref_logprobs", "advantages",
                    "values"):
            assert len(r[col]) == n, col
        assert "".join(r["pieces"]) == r["text"] == tok.decode(r["token_ids"], skip_special_tokens=False)
        assert set(r["roles"]) <= {"prompt", "policy", "observation"} and r["roles"][0] == "prompt"
        policy = [j for j in range(n) if r["roles"][j] == "policy"]
        assert policy and all(r["loss_mask"][j] == 1 for j in policy) and sum(r["loss_mask"]) == len(policy)
        for col in ("logprobs", "trainer_logprobs", "ref_logprobs", "advantages", "values"):
            assert all(r[col][j] is not None for j in policy), col
            assert all(r[col][j] is None for j in range(n) if j not in policy), col
        assert r["score"] == pytest.approx(sum(r["turn_rewards"]))
        assert set(r) >= {"question", "answer", "correct", "task", "info"}
        if r["step"] == 1:
            # before any update the trainer's forward is the sampler's model: the columns line up token by token
            for j in policy:
                assert r["trainer_logprobs"][j] == pytest.approx(r["logprobs"][j], abs=2e-3)
                assert r["ref_logprobs"][j] == pytest.approx(r["logprobs"][j], abs=2e-3)


def test_report_html_is_self_contained_with_curves_and_coloured_tokens(ppo_run):
    assert main(["report", str(ppo_run)]) == 0
    text = (ppo_run / "report.html").read_text()
    page = Page()
    page.feed(text)
    imgs = [a["src"] for t, a in page.tags if t == "img"]
    assert len(imgs) >= 8 and all(src.startswith("data:image/png;base64,") for src in imgs)
    titles = {a["alt"] for t, a in page.tags if t == "img"}
    assert {"Accuracy (training episodes)", "Tool use", "KL to the reference (per token)", "Entropy (per token)",
            "Clip fraction", "Value explained variance", "Logprob mismatch, sampler vs trainer"} <= titles
    # nothing fetched from anywhere: no external scripts, styles or images
    assert not [a for t, a in page.tags if t in ("script", "link", "img", "iframe") and
                any(str(a.get(k, "")).startswith(("http", "//")) for k in ("src", "href"))]
    assert not [t for t, a in page.tags if t == "link"]
    episodes = [a for t, a in page.tags if t == "div" and "ep" in a.get("class", "").split()]
    assert len(episodes) == 6 and {a["data-step"] for a in episodes} == {"1", "2"}
    token_classes = [c for c in classes(page, "span") if "tok" in c]
    roles = {r for c in token_classes for r in c - {"tok"}}
    assert {"prompt", "policy"} <= roles <= {"prompt", "policy", "observation"}
    policy = [a for t, a in page.tags if t == "span" and a.get("class") == "tok policy" and "title" in a]
    assert len(policy) > 20 and all("data-lp" in a and "data-adv" in a and "advantage" in a["title"] for a in policy)
    for sel in ("f-step", "f-correct", "f-tool", "f-colour"):
        assert any(a.get("id") == sel for t, a in page.tags if t == "select")
    assert "Summary" in "".join(page.text) and "before" in "".join(page.text)


def test_report_opens_in_headless_chromium(ppo_run, tmp_path):
    from agentrl.jobs.report import find_browser, screenshot, write_report

    if find_browser() is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
    from PIL import Image

    png = screenshot(write_report(ppo_run), tmp_path / "shot.png", width=1000, height=1400)
    img = Image.open(png).convert("RGB")
    assert img.size == (1000, 1400)
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 200  # text, cards and curves; a blank or error page has a handful
    small = img.resize((50, 70)).convert("L")
    assert max(small.getdata()) - min(small.getdata()) > 100


def test_tensorboard_events_read_back(ppo_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(ppo_run.rglob("events.out.tfevents.*"))
    assert events and all(str(e).startswith(str(ppo_run)) for e in events)
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"env/accuracy", "objective/kl", "ppo/loss/total"} <= set(tags)
    metrics = [json.loads(line) for line in (ppo_run / "metrics.jsonl").read_text().splitlines()]
    kl = acc.Scalars("objective/kl")
    assert [e.step for e in kl] == [m["step"] for m in metrics] == [1, 2, 3]
    assert [e.value for e in kl] == pytest.approx([m["objective/kl"] for m in metrics], rel=1e-5, abs=1e-7)


def _wandb_records(path: Path):
    """Records of a .wandb file: a 7-byte W&B header, then LevelDB-log framing (32 KiB blocks of records with a
    7-byte header: crc32c, little-endian length, type 1 full / 2 first / 3 middle / 4 last), each a protobuf
    Record. W&B ships no Python reader for its own file any more, so the framing is undone here."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - (pos % block)
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tiny_base, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install agentrl[wandb])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # a run or a W&B session an earlier test left (conftest's WANDB_MODE=disabled) would keep its settings
    wandb.finish()
    wandb.teardown()
    out = tmp_path / "run"
    assert main(["grpo", "--config", "grpo", f"model.base={tiny_base}", f"out_dir={out}", "steps=2",
                 "grpo.tasks_per_step=2", "grpo.num_generations=2", "env.name=agentrl.envs:CalculatorEnv",
                 "env.tasks=agentrl.envs:calculator_tasks", "env.train_tasks=32", "env.eval_tasks=4",
                 "rollout.max_new_tokens=12", "progress=false", "grpo.log_with=wandb"]) == 0
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(files[0]) if r.HasField("history")]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [1, 2]
    assert [h["grpo/mean_scores"] for h in history] == pytest.approx([m["grpo/mean_scores"] for m in metrics])
    # GRPO samples: one advantage per episode, on every policy token
    for row in read_jsonl(out / "samples.jsonl"):
        advs = {a for a, role in zip(row["advantages"], row["roles"]) if role == "policy"}
        assert len(advs) == 1 and None not in advs


def test_dpo_pairs_and_compare_samples_render_side_by_side(tiny_base, tmp_path):
    out = tmp_path / "dpo"
    assert main(["dpo", "--config", "dpo", f"model.base={tiny_base}", f"out_dir={out}", "iterative.rounds=1",
                 "iterative.tasks_per_round=32", "env.train_tasks=64", "env.eval_tasks=4", "rollout.max_new_tokens=16",
                 "progress=false", "dpo.per_device_train_batch_size=4", "dpo.num_train_epochs=1"]) == 0
    pairs = read_jsonl(out / "samples.jsonl")
    assert pairs and all(p["kind"] == "pair" and p["chosen"]["score"] > p["rejected"]["score"] for p in pairs)
    cmp = tmp_path / "cmp"
    assert main(["compare", "--a", tiny_base, "--b", f"{tiny_base}:{out / 'adapter'}", "--tasks", "3",
                 "--max-new-tokens", "12", "--out", str(cmp / "compare.json")]) == 0
    ab = read_jsonl(cmp / "samples.jsonl")
    assert len(ab) == 3 and all(r["kind"] == "compare" and r["a"]["question"] == r["b"]["question"] for r in ab)
    for run in (out, cmp):
        assert main(["report", str(run)]) == 0
        page = Page()
        page.feed((run / "report.html").read_text())
        assert len([a for t, a in page.tags if t == "div" and a.get("class") == "pair"]) == len(read_jsonl(
            run / "samples.jsonl"))
        assert len([a for t, a in page.tags if t == "div" and a.get("class") == "side"]) == 2 * len(
            read_jsonl(run / "samples.jsonl"))


def test_compare_two_runs_overlays_their_curves(ppo_run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "env/accuracy": s / 4}) + "\n"
                                                 for s in (1, 2, 3)))
    out = tmp_path / "cmp.html"
    assert main(["report", "--compare", str(ppo_run), str(other), "--out", str(out)]) == 0
    assert f"report: {out}" in capsys.readouterr().out
    page = Page()
    page.feed(out.read_text())
    assert any(a.get("alt") == "Accuracy (training episodes)" for t, a in page.tags if t == "img")
    assert main(["report", str(tmp_path / "missing")]) == 2  # one line, not a traceback
    assert capsys.readouterr().err.endswith(f"agentrl: error: {tmp_path / 'missing'}: no such run directory\n")


def test_token_pieces_concatenate_across_multibyte_characters(tiny_base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    text = "Answer: 3 × 4 = 12 ✓ naïve"
    ids = tok(text, add_special_tokens=True)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids, skip_special_tokens=False)


def test_episode_record_aligns_batch_positions_to_tokens():
    """Position t of a TokenBatch tensor predicts token t+1: token j's number is tensor[row, j-1]."""
    from agentrl.rollout.engine import Episode

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + i) for i in ids)

    ep = Episode(task={"question": "q", "answer": "1"}, prompt_ids=[0, 1], token_ids=[2, 3, 4, 5],
                 loss_mask=[1, 1, 0, 1], logprobs=[-0.1, -0.2, 0.0, -0.4], turn_ends=[1, 3], turn_rewards=[0.0, 1.0],
                 info={"correct": True, "answer": "1", "tool_calls": 1})
    adv = torch.tensor([[9.0, 10.0, 11.0, 12.0, 13.0, 99.0]])  # (1, T-1) with one pad position
    rec = episode_record(ep, Tok(), {"advantages": adv, "values": None, "per_episode": torch.tensor([0.5])}, 0)
    assert rec["roles"] == ["prompt", "prompt", "policy", "policy", "observation", "policy"]
    assert rec["advantages"] == [None, None, 10.0, 11.0, None, 13.0]
    assert rec["per_episode"] == [None, None, 0.5, 0.5, None, 0.5] and "values" not in rec
    assert rec["logprobs"] == [None, None, -0.1, -0.2, None, -0.4]
    assert rec["turn_ends"] == [3, 5] and rec["text"] == "ABCDEF" and rec["correct"]
