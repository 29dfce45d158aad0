"""A user's own environment in under 30 lines: answer with the word in the question.

    agentrl ppo --config quickstart env.name=examples.echo_env:EchoEnv env.tasks=examples.echo_env:echo_tasks
"""

import random
import re

from agentrl.envs import StepResult

class EchoEnv:
    stop_patterns = ()  # regexes that end a turn besides EOS
    max_turns = 1

    def reset(self, task: dict) -> str:
        self.word = task["word"]
        return f"Say {task['word']}:\n"

    def step(self, action: str) -> StepResult:
        said = re.findall(r"[a-z]+", action)[:1] == [self.word]
        return StepResult(observation=None, reward=1.0 if said else -1.0, done=True, info={"correct": said})


def echo_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    return [{"word": "".join(rng.choices("abcdefghij", k=5)) + split[0]} for _ in range(n)]
