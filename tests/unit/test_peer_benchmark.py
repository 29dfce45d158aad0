"""The peer benchmark's bookkeeping (benchmarks/peers/run.py): medians over timed steps, the ratio, the table.
The benchmark itself runs for minutes in other venvs and is not part of the suite."""

import importlib.util
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(PEERS))
    spec = importlib.util.spec_from_file_location("peers_run", PEERS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(PEERS))


def process(steps, warmup=1, rss=100.0, changed=2, tensors=2, change=1e-3):
    return {"steps": steps, "cpu_steps": [s / 2 for s in steps], "warmup": warmup, "peak_rss_mb": rss,
            "moved": {"tensors": tensors, "compared": tensors, "changed": changed, "max_abs_change": change}}


def test_summary_drops_warmup_takes_median_and_largest_rss(run):
    s = run.summarise([process([9.0, 1.0, 3.0], rss=120.0), process([8.0, 2.0, 5.0], rss=110.0)])
    assert s["steps_timed"] == 4  # the warm-up step of each process is not timed
    assert s["s_per_step"] == pytest.approx(2.5)  # median of 1, 2, 3, 5
    assert s["peak_rss_mb"] == 120.0 and s["moved"] is True


def test_a_side_whose_parameters_did_not_move_is_flagged(run):
    assert run.summarise([process([1.0, 1.0]), process([1.0, 1.0], changed=0, change=0.0)])["moved"] is False


def test_ratio_and_table(run):
    agentrl = run.summarise([process([0.0, 2.0])])
    peer = run.summarise([process([0.0, 3.0], rss=90.0, changed=0)])
    assert run.ratio(agentrl, peer) == pytest.approx(1.5)  # peer / agentrl: above 1, agentrl is faster
    text = run.table([{"label": "PPO", "model": "Llama 26 M", "peer_name": "TRL 0.11.4", "agentrl": agentrl,
                       "peer": peer}])
    row = text.splitlines()[2]
    assert row == ("| PPO | Llama 26 M | 2.000 | TRL 0.11.4 | 3.000 | x1.50 | 1.000 / 1.500 | x1.50 | - | 100 / 90 MB "
                   "| yes / NO |")


def test_digit_reward_varies_with_text(run):
    import common

    assert common.digit_reward("a1b2") == 0.5 and common.digit_reward("") == 0.0


def test_a_vocabulary_variant_of_the_26m_model_is_labelled_and_timed_like_it(run):
    assert run.model_label("26m") == "Llama 26 M"
    assert run.model_label("26m-v151936") == "Llama 26 M body, vocabulary 151,936"
    assert run.base_model("26m-v151936") == run.base_model("26m") == "26m"  # timed with 26m's STEPS


STEPPER = """
import sys, time
sys.path.insert(0, {peers!r})
import common
clock = common.StepClock()
clock.tick()
for i in range(int(sys.argv[2])):
    start = time.time()
    while time.time() - start < 0.05:  # a step: busy, as a training step is
        pass
    print(sys.argv[1], start, time.time(), flush=True)
    clock.tick()
print("PEER-RESULT {{}}", flush=True)
"""


@pytest.fixture
def stepper(tmp_path):
    """A script that runs N busy 50 ms "steps" under common.StepClock, printing each one's start and end, and the
    environment to run it in (without a lockstep variable of its own)."""
    import os

    script = tmp_path / "stepper.py"
    script.write_text(STEPPER.format(peers=str(PEERS)))
    return script, {k: v for k, v in os.environ.items() if k != "AGENTRL_PEERS_LOCKSTEP"}


def test_lockstep_processes_take_turns_and_never_overlap(run, stepper):
    script, env = stepper
    done = run.lockstep([([sys.executable, str(script), "A", "4"], env), ([sys.executable, str(script), "B", "4"], env)])
    assert [code for code, _, _ in done] == [0, 0], done
    steps = sorted((float(t0), float(t1), who) for _, out, _ in done for who, t0, t1 in
                   (line.split() for line in out.splitlines() if line[0] in "AB"))
    assert [who for _, _, who in steps] == list("ABABABAB")  # the first command starts, then turns
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(steps, steps[1:]))  # one at a time


def test_in_lockstep_a_process_goes_on_alone_when_the_other_exits(run, stepper):
    script, env = stepper
    done = run.lockstep([([sys.executable, str(script), "A", "1"], env), ([sys.executable, str(script), "B", "3"], env)])
    assert [code for code, _, _ in done] == [0, 0]
    assert sum(line.startswith("B ") for line in done[1][1].splitlines()) == 3  # no hang after A is gone


def test_paired_ratios_compare_steps_of_the_same_index(run):
    agentrl = [process([9.0, 2.0, 4.0]), process([9.0, 1.0])]  # cpu_steps are half of steps
    peer = [process([9.0, 3.0, 4.0]), process([9.0, 2.0])]
    assert run.paired_ratios(agentrl, peer) == [1.5, 1.0, 2.0]
    assert run.paired([1.5, 1.0, 2.0]) == "x1.50 (1.00-2.00)" and run.paired([]) == "-"


def test_in_lockstep_a_process_that_cannot_start_stops_the_other(run, stepper, tmp_path, monkeypatch):
    import subprocess

    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    script, env = stepper
    with pytest.raises(FileNotFoundError):  # e.g. a peer venv that setup.sh did not make
        run.lockstep([([sys.executable, str(script), "A", "50"], env), ([str(tmp_path / "no-python"), "B"], env)])
    assert len(started) == 1 and started[0].returncode == -9  # killed, not left running its 50 steps alone


def test_the_real_models_workload_sets_both_sides_batches_and_the_labels_say_them(run, tmp_path):
    import common

    work = {"ppo_query_ids": [[1] * 160, [2] * 173] * 8, "pair_tokens_mean": 236.6,
            "settings": common.REAL_MODEL_TASKS}
    assert common.task_settings("ppo", work)["batch_size"] == 16
    assert common.task_settings("ppo", work)["learning_rate"] == common.TASKS["ppo"]["learning_rate"]  # kept
    assert common.task_settings("grpo", {})["prompts"] == common.TASKS["grpo"]["prompts"]  # no overrides
    assert run.label("ppo", work) == "PPO (16 x 160-173+<=48 tokens, mini-batch 8, 2 epochs)"
    assert run.label("grpo", work) == "GRPO (2 prompts x 8, <= 48 new tokens, beta 0)"
    assert run.label("dpo", work) == "DPO (batch 8, ~237 tokens a pair)"
    assert run.label("ppo", {"ppo_query_ids": [[1] * 14] * 64}) == "PPO (64 x 14+<=32 tokens, mini-batch 16, 4 epochs)"
    assert run.workload_path(tmp_path, "smollm2-135m").name == "workload-smollm2-135m.json"
    assert run.workload_path(tmp_path, "26m-v151936").name == "workload.json"
    assert run.model_label("smollm2-135m") == "SmolLM2-135M-Instruct"
