"""The report escapes everything it reads from a run directory: a hostile samples.jsonl or summary.json cannot
inject markup or script into report.html, and text where a number belongs does not crash it."""

import json
from html.parser import HTMLParser

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
