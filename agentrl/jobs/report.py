"""`agentrl report RUN_DIR`: one self-contained HTML page of what a run did.

It reads what a job left in its run directory (summary.json, metrics*.jsonl, samples.jsonl) and writes
RUN_DIR/report.html: the before/after summary, training curves (matplotlib, PNGs inlined as data URIs) and a
trajectory browser (every sampled episode token by token, coloured by who wrote each token). CSS and JS are
inline and nothing is fetched, so the file opens from file:// anywhere. `--compare RUN_A RUN_B` overlays two
runs' curves and summaries.

The page is written by hand: no templating library renders token spans with per-token data, and the page
must not depend on one at view time.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from agentrl.checkpoint import write_text_atomically
from agentrl.errors import UserError
from agentrl.samples import read_jsonl

# Curve panels: (title, [(series label, metric key)]), in the vocabulary every agent trainer logs (README,
# "Metrics"); a panel is drawn when one of its series has data.
PANELS = [
    ("Score (environment)", [("mean score", "env/mean_score")]),
    ("Accuracy (training episodes)", [("accuracy", "env/accuracy")]),
    ("Tool use", [("tool calls / episode", "env/tool_calls_per_episode"),
                  ("episodes calling a tool", "env/tool_call_rate")]),
    ("KL to the reference (per token)", [("KL", "policy/kl")]),
    ("Entropy (per token)", [("entropy", "policy/entropy")]),
    ("Clip fraction", [("policy", "policy/clipfrac"), ("value", "ppo/val/clipfrac")]),
    ("Value explained variance", [("explained variance", "ppo/val/var_explained")]),
    ("Response length (sampled tokens)", [("tokens / episode", "env/mean_response_length")]),
    ("Truncation and format errors", [("truncated", "env/truncation_rate"),
                                      ("format errors", "env/format_error_rate"),
                                      ("tool failures", "tools/failure_rate")]),
    ("Logprob mismatch, sampler vs trainer", [("mean |difference| per token", "rollout/logprob_mismatch_mean"),
                                              ("max |difference|", "rollout/logprob_mismatch_max")]),
    ("DPO loss", [("loss", "loss")]),
    ("DPO reward accuracy and margin", [("accuracy", "rewards/accuracies"), ("margin", "rewards/margins")]),
]
RATE_PANELS = {"Accuracy (training episodes)", "Truncation and format errors"}
SUMMARY_ROWS = ("accuracy", "tool_call_rate", "mean_score", "format_error_rate", "truncation_rate", "mean_turns")


class RunDirError(UserError, FileNotFoundError):
    """A run directory that is missing or holds nothing to report on (one line from the command line)."""


# --- reading a run --------------------------------------------------------------------------------------

def load_run(run_dir: str | Path) -> dict:
    """summary, metric rows (DPO rounds chained into one step axis), samples and compare results of a run."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"{run}: no such run directory")
    summary = {}
    if (run / "summary.json").exists():
        try:
            summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{run / 'summary.json'}: not valid JSON ({e})") from None
        if not isinstance(summary, dict):
            raise UserError(f"{run / 'summary.json'}: expected a JSON object, got {type(summary).__name__}")
    metrics = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    offset = 0
    for path in sorted(run.glob("metrics-round*.jsonl"), key=lambda p: int(p.stem.removeprefix("metrics-round"))):
        rows = read_jsonl(path)
        for row in rows:
            metrics.append({**row, "step": offset + row.get("step", 0)})
        offset += max((r.get("step", 0) for r in rows), default=0)
    samples = read_jsonl(run / "samples.jsonl") if (run / "samples.jsonl").exists() else []
    samples = _well_formed(samples, run / "samples.jsonl")
    _add_mismatch(metrics, samples)
    if not (summary or metrics or samples or (run / "samples.jsonl").exists()):
        raise RunDirError(f"{run}: no summary.json, metrics.jsonl or samples.jsonl to report on (is it the "
                          f"out_dir of a ppo, grpo or dpo job?)")
    return {"dir": run, "name": run.name, "summary": summary, "metrics": metrics, "samples": samples}


def _numbers(value) -> bool:
    return isinstance(value, list) and all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
                                           for x in value)


def _sample_problem(row) -> str | None:
    """What keeps a samples.jsonl row from being drawn, or None (the files are ours, but a report must not
    fall over on one that was edited or written by other code)."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    kind, step = row.get("kind", "episode"), row.get("step", 0)
    if not isinstance(kind, str) or isinstance(step, bool) or not isinstance(step, int):
        return "'kind' must be a string and 'step' an integer"
    if kind == "episode":
        if any(k in row and not _numbers(row[k]) for k in ("logprobs", "trainer_logprobs")):
            return "'logprobs' / 'trainer_logprobs' must be lists of numbers"
        if row.get("trainer_logprobs") and "logprobs" not in row:
            return "'trainer_logprobs' without 'logprobs'"
        return None
    sides = ("chosen", "rejected") if kind == "pair" else ("a", "b")
    if not all(isinstance(row.get(x), dict) for x in sides):
        return f"a {kind!r} row needs objects {sides[0]!r} and {sides[1]!r}"
    return None


def _well_formed(samples: list, path: Path) -> list[dict]:
    kept = []
    for i, row in enumerate(samples, 1):
        problem = _sample_problem(row)
        if problem is None:
            kept.append(row)
        else:
            warnings.warn(f"{path}: row {i} skipped: {problem}", stacklevel=2)
    return kept


def _add_mismatch(metrics: list[dict], samples: list[dict]) -> None:
    """Where samples carry the trainer's logprobs and metrics do not already have a mismatch figure: the mean
    |sampler - trainer| logprob over the sampled episodes' policy tokens, on the metrics row of that step."""
    if any("mismatch" in k for row in metrics for k in row):
        return
    by_step: dict[int, list[float]] = {}
    for s in samples:
        if s.get("kind") == "episode" and s.get("trainer_logprobs"):
            by_step.setdefault(s["step"], []).extend(
                abs(a - b) for a, b in zip(s["logprobs"], s["trainer_logprobs"]) if a is not None and b is not None)
    rows = {r.get("step"): r for r in metrics}
    for step, diffs in by_step.items():
        if diffs and step in rows:
            rows[step]["rollout/logprob_mismatch_mean"] = sum(diffs) / len(diffs)


# --- curves ---------------------------------------------------------------------------------------------

def _series(metrics: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in metrics if _finite(r.get(key)) and _finite(r.get("step"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ema(ys: list[float], n: int) -> list[float]:
    alpha, out, m = 2.0 / (max(n // 10, 1) + 1), [], None
    for y in ys:
        m = y if m is None else alpha * y + (1 - alpha) * m
        out.append(m)
    return out


def curve_images(runs: list[dict]) -> list[tuple[str, str]]:
    """(title, PNG data URI) per panel that has data in any of `runs`; runs overlaid by colour. A panel that
    matplotlib cannot draw (values near float's limits leave it no ticks) is left out with a warning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []
    for title, series in PANELS:
        data = [(run, label, *_series(run["metrics"], key)) for run in runs for label, key in series]
        if not any(xs for _, _, xs, _ in data):
            continue
        fig, ax = plt.subplots(figsize=(4.4, 2.5), dpi=90)
        try:
            images.append((title, "data:image/png;base64," + base64.b64encode(_draw(fig, ax, title, series, runs,
                                                                                    data)).decode()))
        except (ValueError, OverflowError) as e:
            warnings.warn(f"report: the {title!r} panel is not drawn: matplotlib cannot place its values ({e})",
                          stacklevel=2)
        finally:
            plt.close(fig)
    return images


def _draw(fig, ax, title: str, series, runs: list[dict], data: list) -> bytes:
    """One panel's PNG: each run's series (raw values faint and smoothed on top when there are many)."""
    from matplotlib.ticker import MaxNLocator

    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    styles = ["-", "--", ":"]
    for run_i, run in enumerate(runs):
        for s_i, (label, _) in enumerate(series):
            _, _, xs, ys = data[run_i * len(series) + s_i]
            if not xs:
                continue
            name = label if len(runs) == 1 else (run["name"] if len(series) == 1 else f"{run['name']}: {label}")
            colour = colours[(run_i if len(runs) > 1 else s_i) % len(colours)]
            style = styles[s_i % len(styles)] if len(runs) > 1 else "-"
            if len(xs) > 8:  # raw values faint, smoothed on top
                ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1, linestyle=style)
                ax.plot(xs, _ema(ys, len(ys)), color=colour, linewidth=1.8, linestyle=style, label=name)
            else:
                ax.plot(xs, ys, color=colour, linewidth=1.8, linestyle=style, marker="o", markersize=3, label=name)
    if title in RATE_PANELS:
        ax.set_ylim(-0.03, 1.03)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if len(runs) > 1 or len(series) > 1:
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --- HTML pieces ----------------------------------------------------------------------------------------

def esc(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x, nd: int = 3) -> str:
    """A number to `nd` decimals; anything else as escaped text."""
    if isinstance(x, bool) or x is None:
        return str(x)
    return f"{x:.{nd}f}" if isinstance(x, float) else esc(x)


def _number(x) -> float | None:
    """x when it is a real number (samples.jsonl is read as found: a hand-edited or foreign file may hold text)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _first_last(metrics: list[dict], key: str) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and over the last tenth of the steps (at least one step each)."""
    ys = _series(metrics, key)[1]
    if not ys:
        return None, None
    k = max(len(ys) // 10, 1)
    return sum(ys[:k]) / k, sum(ys[-k:]) / k


def summary_html(runs: list[dict]) -> str:
    """Headline cards (first run) and the before/after table, sampled before greedy."""
    parts = []
    s = runs[0]["summary"]
    if len(runs) == 1 and s.get("before_sampled") and s.get("after_sampled"):
        cards = [("accuracy, sampled (T=1)", "before_sampled", "after_sampled", "accuracy"),
                 ("accuracy, greedy", "before", "after", "accuracy"),
                 ("tool-call rate, sampled", "before_sampled", "after_sampled", "tool_call_rate"),
                 ("format errors, sampled", "before_sampled", "after_sampled", "format_error_rate")]
        parts.append('<div class="cards">')
        for label, b, a, key in cards:
            x, y = _number(s[b].get(key)), _number(s[a].get(key))
            if x is None or y is None:
                continue
            good = (y > x) if key != "format_error_rate" else (y < x)
            cls = "up" if good and abs(y - x) > 1e-9 else ("down" if abs(y - x) > 1e-9 else "flat")
            parts.append(f'<div class="card {cls}"><div class="lab">{esc(label)}</div><div class="big">'
                         f'{x:.2f} &rarr; {y:.2f}</div><div class="lab">before &rarr; after training</div></div>')
        first, last = _first_last(runs[0]["metrics"], "env/tool_call_rate")
        if first is not None:
            parts.append(f'<div class="card {"up" if last > first else "flat"}"><div class="lab">training episodes '
                         f'calling a tool</div><div class="big">{first:.2f} &rarr; {last:.2f}</div>'
                         f'<div class="lab">first &rarr; last steps</div></div>')
        parts.append("</div>")
    columns = [(r, dec, x) for r in runs for dec, pair in (("sampled (T=1)", ("before_sampled", "after_sampled")),
                                                          ("greedy", ("before", "after")))
               for x in pair if r["summary"].get(x)]
    if columns:
        head = "".join(f"<th>{esc(r['name']) + '<br>' if len(runs) > 1 else ''}{esc(dec)}<br>"
                       f"{'before' if x.startswith('before') else 'after'}</th>" for r, dec, x in columns)
        rows = "".join(f"<tr><td>{esc(key)}</td>" + "".join(f"<td>{_fmt(r['summary'][x].get(key))}</td>"
                                                           for r, _, x in columns) + "</tr>" for key in SUMMARY_ROWS)
        parts.append(f'<table class="sum"><tr><th>held-out metric</th>{head}</tr>{rows}</table>')
    facts = []
    for r in runs:
        rs = r["summary"]
        bits = [f"{k}: {esc(rs[k])}" for k in ("algo", "steps", "episodes", "eval_tasks", "train_seconds",
                                                "wall_seconds", "pairs") if k in rs]
        facts.append(f"<li><b>{esc(r['name'])}</b> ({esc(r['dir'])}): {', '.join(bits) or 'no summary.json'}</li>")
    parts.append(f'<ul class="facts">{"".join(facts)}</ul>')
    for r in runs:
        parts.append(retention_html(r))
    for r in runs:
        if r["summary"].get("config"):
            parts.append(f"<details><summary>config of {esc(r['name'])}</summary><pre>"
                         f"{esc(json.dumps(r['summary']['config'], indent=2))}</pre></details>")
    return "\n".join(parts)


def retention_html(run: dict) -> str:
    """What the model knew (summary "retention", jobs/retention.py): the reference's answers to general prompts
    scored under the reference, the policy before and after training; empty when the run did not measure it."""
    ret = run["summary"].get("retention")
    if not isinstance(ret, dict):
        return ""
    cells = [(label, ret.get(key)) for label, key in (("reference", "reference"), ("before training", "before"),
                                                      ("after training", "after"))]
    rows = "".join(f"<tr><td>{esc(label)}</td><td>{_fmt((m or {}).get('nll'))}</td><td>{_fmt((m or {}).get('kl'))}</td>"
                   f"</tr>" for label, m in cells if isinstance(m, dict))
    rise = _number(ret.get("nll_rise"))
    note = f"NLL of the reference's answers rose by {rise:.1%} from the reference" if rise is not None else ""
    return (f'<table class="sum"><tr><th>general prompts ({esc(run["name"])}): the reference\'s own answers</th>'
            f"<th>NLL per token</th><th>KL to the reference</th></tr>{rows}</table><p>{esc(note)}</p>")


def verdict(ep: dict) -> str:
    """What happened in an episode, in words, from what the environment reported: why it failed."""
    info = ep.get("info") or {}
    expected, got = ep.get("answer"), ep.get("prediction")
    calls = info.get("tool_calls", 0)
    bad_calls = info.get("format_errors") or info.get("tool_failures")
    used = (f"after {calls} tool call{'s' if calls != 1 else ''}" if calls else
            "with no successful tool call" if bad_calls else "without calling the tool")
    if ep.get("correct"):
        return f"correct answer {got!s} {used}"
    reasons = []
    if bad_calls:
        reasons.append("malformed or failed tool call")
    if ep.get("truncated"):
        reasons.append("cut off at max_new_tokens")
    reasons.append(f"no answer {used}" if got is None else f"wrong answer {got!s} {used}")
    return "; ".join(reasons) + (f" (expected {expected})" if expected is not None else "")


def _num_attr(name: str, value) -> str:
    return f' data-{name}="{value:.4g}"' if isinstance(value, (int, float)) else ""


def tokens_html(ep: dict) -> str:
    """Token spans coloured by role; numbers on hover (title) and in data-* attributes for the colour modes;
    a reward badge after each turn's last token."""
    n = len(ep["token_ids"])
    cols = {k: ep.get(k) or [None] * n for k in ("logprobs", "trainer_logprobs", "ref_logprobs", "advantages", "values")}
    ends = dict(zip(ep.get("turn_ends", []), ep.get("turn_rewards", [])))
    out, prompt = [], []
    for j in range(n):
        role = ep["roles"][j]
        lp, tlp, ref, adv, val = (_number(cols[k][j]) for k in cols)
        tip = [f"token {ep['token_ids'][j]} · {role}"]
        for label, v in (("logprob", lp), ("trainer logprob", tlp), ("ref logprob", ref), ("advantage", adv),
                         ("value", val)):
            if v is not None:
                tip.append(f"{label} {v:+.3f}" + (f" (p={math.exp(min(v, 0.0)):.2f})" if label == "logprob" else ""))
        data = _num_attr("lp", lp) + _num_attr("adv", adv)
        if lp is not None and tlp is not None:
            data += _num_attr("mm", abs(lp - tlp))
        # Every value from samples.jsonl is escaped, attributes included: the file may come from anyone.
        span = f'<span class="tok {esc(role)}" title="{esc(" · ".join(tip))}"{data}>{esc(ep["pieces"][j])}</span>'
        (prompt if role == "prompt" else out).append(span)
        if j in ends:
            reward = _number(ends[j])
            out.append(f'<span class="rw" title="reward of this turn">reward '
                       f'{f"{reward:+.2f}" if reward is not None else esc(ends[j])}</span>')
    return f'<span class="promptblock">{"".join(prompt)}</span>{"".join(out)}'


def episode_html(ep: dict, label: str = "") -> str:
    info = ep.get("info") or {}
    ok = bool(ep.get("correct"))
    badge = '<span class="badge ok">correct</span>' if ok else '<span class="badge bad">incorrect</span>'
    score = _number(ep.get("score", 0))
    facts = [f"score {score:+.2f}" if score is not None else f"score {esc(ep.get('score'))}",
             f"turns {len(ep.get('turn_ends', []))}", f"tool calls {esc(info.get('tool_calls', 0))}"]
    if ep.get("truncated"):
        facts.append("truncated")
    return (f'<div class="epbody"><div class="ephead">{badge} {esc(label)} <span class="facts2">{" · ".join(facts)}</span></div>'
            f'<div class="q"><b>task</b> {esc(ep.get("question") or json.dumps(ep.get("task")))}</div>'
            f'<div class="why">{esc(verdict(ep))}</div>'
            f'<div class="toks">{tokens_html(ep)}</div></div>')


def samples_html(samples: list[dict]) -> str:
    cards = []
    for k, s in enumerate(samples):
        kind = s.get("kind", "episode")
        step = s.get("step", 0)
        if kind == "episode":
            body = episode_html(s, f"step {step} · episode {s.get('index', '')} ({s.get('source', '')})")
            correct, tool = s.get("correct"), (_number((s.get("info") or {}).get("tool_calls")) or 0) > 0
        else:
            a, b = ("chosen", "rejected") if kind == "pair" else ("a", "b")
            what = f"round {step} · pair {s.get('index', '')}" if kind == "pair" else f"task {s.get('index', '')}"
            head = f'<div class="pairhead">{esc(what)}</div>'
            body = head + '<div class="pair">' + "".join(
                f'<div class="side"><div class="sidename">{esc(s.get(f"name_{x}", x))}</div>{episode_html(s[x])}</div>'
                for x in (a, b)) + "</div>"
            correct = s[a].get("correct")
            tool = any((_number((s[x].get("info") or {}).get("tool_calls")) or 0) > 0 for x in (a, b))
        cards.append(f'<div class="ep" id="ep{k}" data-kind="{esc(kind)}" data-step="{esc(step)}" '
                     f'data-correct="{int(bool(correct))}" data-tool="{int(bool(tool))}">{body}</div>')
    return "\n".join(cards)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 22px;display:flex;gap:22px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}header a{color:#9cc3ff;text-decoration:none}
main{padding:8px 22px 40px;max-width:1500px}
h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #d6dae1;padding-bottom:3px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:6px 0 12px}
.card{background:#fff;border:1px solid #d6dae1;border-left:6px solid #9aa3b2;border-radius:6px;padding:8px 14px;min-width:190px}
.card.up{border-left-color:#2e9d4f}.card.down{border-left-color:#c8372d}
.card .big{font-size:24px;font-weight:600}.card .lab{font-size:12px;color:#5b6473}
table.sum{border-collapse:collapse;background:#fff;font-size:13px}
table.sum td,table.sum th{border:1px solid #d6dae1;padding:3px 10px;text-align:right}
table.sum td:first-child{text-align:left}
ul.facts{font-size:12px;color:#5b6473;margin:8px 0;padding-left:18px}
pre{background:#fff;border:1px solid #d6dae1;padding:8px;font-size:11px;max-height:320px;overflow:auto}
.curves{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:8px}
.curves img{width:100%;background:#fff;border:1px solid #d6dae1;border-radius:4px}
.controls{position:sticky;top:0;z-index:2;background:#f6f7f9;padding:8px 0;display:flex;gap:14px;flex-wrap:wrap;
 align-items:center;border-bottom:1px solid #d6dae1;font-size:13px}
.controls select{font-size:13px}
.legend span{margin-right:8px}
.ep{background:#fff;border:1px solid #d6dae1;border-radius:6px;margin:10px 0;padding:8px 12px}
.ephead{font-size:12px;color:#5b6473}.facts2{margin-left:6px}
.badge{display:inline-block;border-radius:3px;padding:0 6px;font-weight:600;color:#fff;font-size:12px}
.badge.ok{background:#2e9d4f}.badge.bad{background:#c8372d}
.q{margin:3px 0}.why{font-size:13px;margin:2px 0 6px;color:#333;font-style:italic}
.toks{font:12.5px/1.7 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-word}
.tok{border-radius:2px}
.tok.prompt{color:#7a8291}
.tok.policy{background:#dbe9ff;color:#0b2a5b}
.tok.observation{background:#ffe3b3;color:#5a3700}
.rw{font:11px system-ui,sans-serif;background:#1d2330;color:#fff;border-radius:3px;padding:0 4px;margin:0 3px;white-space:nowrap}
body.noprompt .promptblock{display:none}
body.mode-lp .tok.policy,body.mode-adv .tok.policy,body.mode-mm .tok.policy{background:#eee}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:10px}.side{border-top:3px solid #9aa3b2;padding-top:4px}
.side:first-child{border-top-color:#2e9d4f}.side:last-child{border-top-color:#c8372d}
.sidename{font-weight:600;font-size:12px;text-transform:uppercase;color:#5b6473}.pairhead{font-size:12px;color:#5b6473}
.hint{font-size:12px;color:#5b6473}
"""

JS = """
const $$ = s => Array.from(document.querySelectorAll(s));
function val(id){ const e = document.getElementById(id); return e ? e.value : 'all'; }
function applyFilters(){
  const step = val('f-step'), out = val('f-correct'), tool = val('f-tool'), kind = val('f-kind');
  let n = 0;
  $$('.ep').forEach(e => {
    const show = (step === 'all' || e.dataset.step === step) && (out === 'all' || e.dataset.correct === out) &&
                 (tool === 'all' || e.dataset.tool === tool) && (kind === 'all' || e.dataset.kind === kind);
    e.style.display = show ? '' : 'none'; if (show) n++;
  });
  document.getElementById('count').textContent = n + ' shown';
}
function colour(){
  const mode = val('f-colour');
  document.body.classList.remove('mode-lp', 'mode-adv', 'mode-mm');
  if (mode !== 'role') document.body.classList.add('mode-' + mode);
  let scale = 1e-6;
  if (mode === 'adv') $$('.tok.policy[data-adv]').forEach(t => scale = Math.max(scale, Math.abs(+t.dataset.adv)));
  $$('.tok.policy').forEach(t => {
    const v = t.dataset[mode];
    if (mode === 'role' || v === undefined) { t.style.background = ''; return; }
    const x = +v;
    if (mode === 'lp') t.style.background = 'hsl(' + Math.round(120 * Math.exp(x)) + ',75%,78%)';
    else if (mode === 'adv') { const a = Math.min(Math.abs(x) / scale, 1);
      t.style.background = 'hsl(' + (x >= 0 ? 130 : 0) + ',70%,' + Math.round(96 - 30 * a) + '%)'; }
    else t.style.background = 'hsl(0,80%,' + Math.round(97 - 35 * Math.min(x / 0.5, 1)) + '%)';
  });
  const legends = {role: 'legend-role', lp: 'legend-lp', adv: 'legend-adv', mm: 'legend-mm'};
  Object.values(legends).forEach(id => { const e = document.getElementById(id); if (e) e.style.display = 'none'; });
  document.getElementById(legends[mode]).style.display = '';
}
function prompts(){ document.body.classList.toggle('noprompt', !document.getElementById('f-prompt').checked); }
window.addEventListener('DOMContentLoaded', () => {
  ['f-step', 'f-correct', 'f-tool', 'f-kind'].forEach(id => { const e = document.getElementById(id);
    if (e) e.addEventListener('change', applyFilters); });
  document.getElementById('f-colour').addEventListener('change', colour);
  document.getElementById('f-prompt').addEventListener('change', prompts);
  // a link can preset the controls: report.html#colour=adv&f-correct=0
  new URLSearchParams(location.hash.slice(1)).forEach((v, k) => {
    const e = document.getElementById(k.startsWith('f-') ? k : 'f-' + k); if (e) e.value = v; });
  applyFilters(); colour(); prompts();
});
"""


def _options(values, labels=None) -> str:
    labels = labels or [str(v) for v in values]
    return "".join(f'<option value="{esc(v)}">{esc(lab)}</option>' for v, lab in zip(values, labels))


def _numbers_first(x) -> tuple:
    """Sort key: numbers in order, then anything else (a foreign samples.jsonl) by its text."""
    return (0, _number(x), "") if _number(x) is not None else (1, 0.0, str(x))


def browser_html(samples: list[dict]) -> str:
    if not samples:
        return '<p class="hint">No samples.jsonl in this run (sample_every / samples_per_step were off).</p>'
    steps = sorted({s.get("step", 0) for s in samples}, key=_numbers_first)
    kinds = sorted({s.get("kind", "episode") for s in samples}, key=_numbers_first)
    n_bad = sum(1 for s in samples if not s.get("correct", (s.get("chosen") or s.get("a") or {}).get("correct")))
    has = {k: any(s.get(k) for s in samples if s.get("kind") == "episode") for k in ("advantages", "trainer_logprobs")}
    colour_opts = [("role", "who wrote it"), ("lp", "sampling logprob")]
    colour_opts += [("adv", "advantage")] if has["advantages"] else []
    colour_opts += [("mm", "sampler vs trainer logprob")] if has["trainer_logprobs"] else []
    prompt_lens = sorted(s["roles"].count("prompt") for s in samples if s.get("kind") == "episode") or [0]
    show_prompt = "checked" if prompt_lens[len(prompt_lens) // 2] <= 120 else ""
    kind_select = (f'<label>kind <select id="f-kind">{_options(["all", *kinds])}</select></label>'
                   if len(kinds) > 1 else "")
    controls = (
        f'<div class="controls">'
        f'<label>step <select id="f-step">{_options(["all", *steps])}</select></label>'
        f'<label>outcome <select id="f-correct">{_options(["all", "0", "1"], ["all", f"incorrect ({n_bad})", f"correct ({len(samples) - n_bad})"])}</select></label>'
        f'<label>tool <select id="f-tool">{_options(["all", "1", "0"], ["all", "called a tool", "no tool call"])}</select></label>'
        f'{kind_select}'
        f'<label>colour <select id="f-colour">{_options(*zip(*colour_opts))}</select></label>'
        f'<label><input type="checkbox" id="f-prompt" {show_prompt}> prompts</label>'
        f'<span id="count"></span>'
        f'<span class="legend" id="legend-role"><span class="tok prompt">prompt</span><span class="tok policy">'
        f'policy (sampled, trained on)</span><span class="tok observation">tool / environment observation</span>'
        f'<span class="rw">reward</span></span>'
        f'<span class="legend hint" id="legend-lp">policy tokens: red = unlikely under the sampler, green = likely</span>'
        f'<span class="legend hint" id="legend-adv">policy tokens: green = positive advantage, red = negative</span>'
        f'<span class="legend hint" id="legend-mm">policy tokens: redder = larger |sampler - trainer| logprob</span>'
        f'</div><p class="hint">Hover a token for its id, logprobs, advantage and value.</p>')
    return controls + samples_html(samples)


def render(runs: list[dict], title: str) -> str:
    curves = curve_images(runs)
    curve_html = "".join(f'<img alt="{esc(t)}" title="{esc(t)}" src="{uri}">' for t, uri in curves) or \
        '<p class="hint">No metrics to draw.</p>'
    browser = browser_html(runs[0]["samples"]) if len(runs) == 1 else ""
    nav = '<a href="#summary">summary</a> <a href="#curves">curves</a>' + (
        ' <a href="#episodes">episodes</a>' if len(runs) == 1 else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{CSS}</style></head>
<body><header><h1>{esc(title)}</h1><nav>{nav}</nav></header><main>
<h2 id="summary">Summary: held-out tasks before and after training</h2>
{summary_html(runs)}
<h2 id="curves">Training curves</h2>
<div class="curves">{curve_html}</div>
{'<h2 id="episodes">Episodes</h2>' + browser if len(runs) == 1 else ''}
</main><script>{JS}</script></body></html>
"""


def _ascii(page: str) -> str:
    """Non-ASCII characters as HTML character references: the file reads the same whatever the locale."""
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """RUN_DIR/report.html (or `out`) for one run; returns its path."""
    run = load_run(run_dir)
    algo = run["summary"].get("algo", "")
    path = Path(out) if out else run["dir"] / "report.html"
    write_text_atomically(path, _ascii(render([run], f"agentrl report: {run['name']}" + (f" ({algo})" if algo else ""))))
    return path


def write_compare(run_a: str | Path, run_b: str | Path, out: str | Path | None = None) -> Path:
    """Two runs' curves overlaid and summaries side by side; default RUN_A/compare-<name of B>.html."""
    a, b = load_run(run_a), load_run(run_b)
    if a["name"] == b["name"]:
        a["name"], b["name"] = str(a["dir"]), str(b["dir"])
    path = Path(out) if out else a["dir"] / f"compare-{Path(run_b).name}.html"
    write_text_atomically(path, _ascii(render([a, b], f"agentrl: {a['name']} vs {b['name']}")))
    return path


def run_report(run: str | None, compare: list[str] | None = None, out: str | None = None,
               screenshot_png: str | None = None) -> Path:
    """`agentrl report`: one run's report, or two runs compared; optionally a PNG of it (the README's picture:
    1280 px wide, the summary, the curves and the first episodes)."""
    path = write_compare(*compare, out=out) if compare else write_report(run, out=out)
    if screenshot_png:
        # Chromium leaves the last rows of a tall headless window blank: they are cropped off
        shrink_png(screenshot(path, screenshot_png, width=1280, height=2400), max_height=2250)
    return path


# --- screenshots (tests and the README's picture) ----------------------------------------------------------

def find_browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def screenshot(html_path: str | Path, png_path: str | Path, width: int = 1280, height: int = 1600,
               timeout: float = 120, fragment: str = "") -> Path:
    """Render a page in headless Chromium (no network, fresh profile) and save a PNG of the first screen."""
    browser = find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
    png_path = Path(png_path).resolve()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", "--virtual-time-budget=3000",
               f"--screenshot={png_path}", Path(html_path).resolve().as_uri() + (f"#{fragment}" if fragment else "")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if not png_path.exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
    return png_path


def shrink_png(path: str | Path, max_width: int = 1000, colours: int = 128, max_height: int | None = None) -> None:
    """Crop to `max_height`, scale down and palette-quantize a screenshot so it is small enough to keep in a
    repository (the README's docs/report.png)."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    if max_height and img.height > max_height:
        img = img.crop((0, 0, img.width, max_height))
    if img.width > max_width:
        img = img.resize((max_width, round(img.height * max_width / img.width)), Image.LANCZOS)
    img.quantize(colours, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
