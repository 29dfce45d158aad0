"""env.tasks_kwargs reach the task function: a config can name a dataset, a game or a server."""

import pytest

from agentrl.envs.base import load_tasks
from agentrl.errors import EnvironmentContractError
from agentrl.jobs.common import EnvSection, tasks_of, training_tasks


def named_tasks(n, seed, split, name="default", size=3):
    return [{"question": f"{name}-{split}-{seed}-{i}", "answer": i} for i in range(min(n, size))]


SPEC = f"{__name__}:named_tasks"


def test_kwargs_reach_the_task_function():
    assert load_tasks(SPEC, 5, 0, "eval")[0]["question"] == "default-eval-0-0"
    tasks = load_tasks(SPEC, 5, 1, "train", {"name": "leg_counting", "size": 2})
    assert [t["question"] for t in tasks] == ["leg_counting-train-1-0", "leg_counting-train-1-1"]


def test_config_section_passes_them():
    env = EnvSection(tasks=SPEC, tasks_kwargs={"name": "chain_sum"}, train_tasks=3)
    assert tasks_of(env, 2, 0, "eval")[0]["question"] == "chain_sum-eval-0-0"
    held_out = tasks_of(env, 2, 0, "eval")
    assert [t["question"] for t in training_tasks(env, 0, held_out)] == [f"chain_sum-train-0-{i}" for i in range(3)]


def test_unknown_kwarg_names_the_call():
    with pytest.raises(EnvironmentContractError, match=r"named_tasks\(2, seed=0, split='eval', colour='red'\)"):
        load_tasks(SPEC, 2, 0, "eval", {"colour": "red"})


def test_kwargs_with_a_jsonl_file_are_an_error(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"question": "q", "answer": 1}\n')
    with pytest.raises(ValueError, match="tasks_kwargs"):
        load_tasks(str(path), 1, 0, "eval", {"name": "x"})
