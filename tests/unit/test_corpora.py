"""The embedded model's corpora: the builder's probe splits demonstrations without changing their tokens."""

import random

import pytest

from agentrl.envs import CORPORA
from agentrl.jobs.base_model import _skip_decision
from agentrl.models.tiny import build_tokenizer
from agentrl.trainers.sft import encode_demonstrations, read_demonstrations


def encode(tokenizer, demos):
    return encode_demonstrations(read_demonstrations(demos), tokenizer)[0]


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_probe_scores_every_token_but_the_decision_and_keeps_the_ids(name):
    corpus = CORPORA[name]
    rng = random.Random(0)
    demos = [corpus.demonstrate(t, True, rng) for t in corpus.tasks(300, seed=0, split="train", unique=False)]
    tokenizer = build_tokenizer(["".join(text for text, _ in d) for d in demos], 512, corpus.special_tokens,
                                corpus.chat_template)
    probes = [_skip_decision(d, corpus.decision) for d in demos]
    for (ids, labels), (probe_ids, probe_labels) in zip(encode(tokenizer, demos), encode(tokenizer, probes)):
        assert probe_ids == ids  # splitting off the decision must not re-tokenize the turn
        unscored = [i for i, (a, b) in enumerate(zip(labels, probe_labels)) if a != b]
        assert unscored and unscored == list(range(unscored[0], unscored[-1] + 1))  # one span, at the start
        assert all(label == -100 for label in labels[:unscored[0]])  # ... of what the model writes
