"""An environment whose own reset or step hangs ends that episode as an infrastructure failure (left out of the loss,
counted as env/timeout_rate) after env.step_timeout seconds; the call is abandoned on a daemon thread, so the run
goes on and the process still exits."""

import subprocess
import sys
import textwrap
import threading
import time

from agentrl.envs.base import StepResult
from agentrl.rollout import SamplingParams, rollout
from agentrl.rollout.engine import episode_metrics
from agentrl.rollout.sampling import Sample
from agentrl.trainers.common import check_batch, episodes_to_batch
from fake_tokenizer import FakeTokenizer

FOREVER = threading.Event()  # never set: a call waiting on it hangs


def writes(text):
    def sampler(contexts, params, eos, pad, **kwargs):
        return [Sample(ids=[ord(c) for c in text], logprobs=[-1.0] * len(text), finish="stop") for _ in contexts]
    return sampler


class HangsOnSome:
    """Task "hang-step" hangs in step, "hang-reset" in reset; the others answer at once."""

    stop_patterns, max_turns, step_timeout = (), 2, 0.2

    def reset(self, task):
        self.task = task
        if task["question"] == "hang-reset":
            FOREVER.wait()
        return "Q: "

    def step(self, action):
        if self.task["question"] == "hang-step":
            FOREVER.wait()
        return StepResult(None, 1.0, True, {"correct": True})


def test_hung_step_and_reset_end_their_episodes_as_infra_failures():
    tasks = [{"question": q} for q in ("a", "hang-step", "b", "hang-reset")]
    started = time.monotonic()
    episodes = rollout(None, FakeTokenizer(), HangsOnSome, tasks, SamplingParams(), sampler=writes("A: 1"))
    assert time.monotonic() - started < 5
    assert [ep.infra_failure for ep in episodes] == [False, True, False, True]
    assert [ep.score for ep in episodes] == [1.0, 0.0, 1.0, 0.0]
    assert episodes[3].num_turns == 0 and episodes[1].num_turns == 1
    assert episode_metrics(episodes)["env/timeout_rate"] == 0.5
    check_batch(episodes, episodes_to_batch(episodes, pad_id=0))  # a batch can be built: trainers mask them out


def test_deadline_off_runs_on_the_callers_thread():
    class Off(HangsOnSome):
        step_timeout = 0

        def step(self, action):
            return StepResult(None, float(threading.current_thread() is threading.main_thread()), True, {})

    episodes = rollout(None, FakeTokenizer(), Off, [{"question": "a"}], SamplingParams(), sampler=writes("A"))
    assert episodes[0].score == 1.0


def test_process_exits_while_a_step_still_hangs(tmp_path):
    # Before: the hung step held the rollout (and the process) forever.
    script = textwrap.dedent("""
        import sys, threading
        sys.path.insert(0, %r)
        from test_reliability_env_timeout import FakeTokenizer, HangsOnSome, writes
        from agentrl.rollout import SamplingParams, rollout
        episodes = rollout(None, FakeTokenizer(), HangsOnSome, [{"question": "hang-step"}], SamplingParams(),
                           sampler=writes("A"))
        print("infra", episodes[0].infra_failure)
    """) % str(__import__("pathlib").Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "infra True" in done.stdout and "env/timeout_rate" in done.stderr


def test_sigterm_while_a_step_hangs_exits():
    # The rollout waits on the hung step's thread; a SIGTERM handler (the jobs' raises SignalExit) still runs.
    script = textwrap.dedent("""
        import signal, sys
        sys.path.insert(0, %r)
        from test_reliability_env_timeout import FakeTokenizer, HangsOnSome, writes
        from agentrl.errors import SignalExit
        from agentrl.rollout import SamplingParams, rollout

        def stop(signum, frame):
            raise SignalExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        HangsOnSome.step_timeout = 600
        print("ready", flush=True)
        rollout(None, FakeTokenizer(), HangsOnSome, [{"question": "hang-step"}], SamplingParams(), sampler=writes("A"))
    """) % str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # into the hung step
        proc.send_signal(__import__("signal").SIGTERM)
        assert proc.wait(timeout=30) == 128 + 15
    finally:
        proc.kill()


def test_the_config_key_sets_the_deadline_and_is_checked():
    import pytest

    from agentrl.config import ConfigError, load_config
    from agentrl.jobs.common import environment_factory
    from agentrl.jobs.ppo import JobConfig

    config = load_config(JobConfig, overrides=["env.step_timeout=2.5"])
    assert environment_factory(config.env)().step_timeout == 2.5
    assert not hasattr(environment_factory(load_config(JobConfig).env)(), "step_timeout")  # None: the env's own
    with pytest.raises(ConfigError, match="env.step_timeout: must be >= 0"):
        load_config(JobConfig, overrides=["env.step_timeout=-1"])
