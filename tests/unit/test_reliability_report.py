"""The report escapes everything it reads from a run directory: a hostile samples.jsonl or summary.json cannot
inject markup or script into report.html, and text where a number belongs does not crash it."""

import json
from html.parser import HTMLParser

import pytest

from agentrl.jobs.report import write_report

PAYLOAD = '"><img src=x onerror=alert(1)>'


class Tags(HTMLParser):
    """The tags and attributes a browser would see."""

    def __init__(self):
        super().__init__()
        self.names, self.attributes, self.values = [], [], []

    def handle_starttag(self, tag, attrs):
        self.names.append(tag)
        self.attributes += [(tag, name) for name, _ in attrs]
        self.values += [(tag, name, value) for name, value in attrs]


def hostile_episode(step, **overrides) -> dict:
    episode = {"kind": "episode", "step": step, "source": PAYLOAD, "index": PAYLOAD, "question": PAYLOAD,
               "answer": PAYLOAD, "prediction": PAYLOAD, "correct": False, "score": PAYLOAD, "truncated": True,
               "info": {"tool_calls": PAYLOAD, "format_errors": 1},
               "token_ids": [1, 2, 3], "pieces": ["<script>", "a", PAYLOAD],
               "roles": ["prompt", 'policy" onmouseover="alert(1)', "observation x onmouseover=alert(1)"],
               "logprobs": [None, "NaN<b>", 800.0], "advantages": [None, PAYLOAD, 0.5],
               "turn_ends": [1, 2], "turn_rewards": [PAYLOAD, 1.0]}
    return {**episode, **overrides}


def test_nothing_from_the_run_directory_reaches_the_page_unescaped(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [hostile_episode(1), hostile_episode(PAYLOAD),
            {"kind": "pair", "step": 1, "source": PAYLOAD, "index": PAYLOAD, "name_chosen": PAYLOAD,
             "chosen": hostile_episode(1), "rejected": hostile_episode(1)}]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "env/mean_score": 0.5}) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "algo": PAYLOAD, "steps": PAYLOAD, "config": {"x": PAYLOAD},
        "before": {"accuracy": PAYLOAD}, "after": {"accuracy": 0.5},
        "before_sampled": {"accuracy": PAYLOAD}, "after_sampled": {"accuracy": 0.5}}))
    page = write_report(run).read_text()
    tags = Tags()
    tags.feed(page)
    assert not [(tag, name) for tag, name in tags.attributes if name.startswith("on")]  # no event handlers
    assert tags.names.count("script") == 1  # the page's own script only
    assert all(value.startswith("data:image/png;base64,") for tag, name, value in tags.values
               if (tag, name) == ("img", "src"))  # the curves only
    assert {value for tag, name, value in tags.values if name == "class" and tag == "span"} >= {
        "tok prompt", 'tok policy" onmouseover="alert(1)'}  # a foreign role stays inside its attribute
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in page  # the text is shown, escaped


def test_a_torn_last_line_is_skipped_and_bad_run_dirs_are_one_line(tmp_path, capsys):
    from agentrl.cli import main

    run = tmp_path / "torn"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "env/mean_score": 0.5}\n{"step": 2, "env/mean_sc')  # killed mid-row
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: skipping a torn last line"):
        assert main(["report", str(run)]) == 0
    assert (run / "report.html").exists()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "env/mean_sc\n{"step": 3}\n')  # broken inside
    (run / "samples.jsonl").write_bytes(b'{"kind": "episode"}\n\xff\xfe\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, message in ((["report", str(run)], f"{run / 'metrics.jsonl'}:2: not valid JSON"),
                          (["report", str(empty)], f"{empty}: no summary.json, metrics.jsonl or samples.jsonl"),
                          (["report", str(tmp_path / "missing")], f"{tmp_path / 'missing'}: no such run directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"agentrl: error: {message}"), err
    (run / "metrics.jsonl").unlink()
    assert main(["report", str(run)]) == 2
    assert f"{run / 'samples.jsonl'}: not UTF-8 text" in capsys.readouterr().err
