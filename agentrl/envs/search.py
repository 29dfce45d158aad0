"""A retrieval environment: a `search(query)` tool over a local collection (BM25 via bm25s).

The shipped collection is synthetic and fictional (made-up countries, capitals, rivers and founders),
so no model can know an answer without searching. A user's own JSONL collection (`{"text": ...}` rows)
works the same way; its tasks are `{"question": ..., "answer": ...}` rows.
"""

from __future__ import annotations

import functools
import random
import re
from pathlib import Path

from agentrl.data import read_jsonl, split_of
from agentrl.envs.base import Corpus
from agentrl.envs.tools import ToolEnv

_SYLLABLES = ["ka", "lo", "mi", "ren", "tor", "va", "sel", "qu", "dar", "ith", "bel", "nor", "sha", "vin", "el", "mor"]
# (fact, question): every question names its relation and subject as "the <relation> of <subject>", which is
# also the query a demonstration searches for, so BM25 ranks the fact that answers it first.
_RELATIONS = [
    ("{y} is the capital of {x}.", "What is the capital of {x}?"),
    ("{y} is the longest river of {x}.", "What is the longest river of {x}?"),
    ("{y} was the founder of {x}.", "Who was the founder of {x}?"),
]
_SUBJECT = re.compile(r"\bthe (.*)\?$")
# The world the environment asks about (seed 0), and the one the embedded base model practises on. They
# pair names differently, so the base model cannot know an answer of the environment's world: it has to
# search and read the result.
ENV_WORLD, PRACTICE_WORLD = 0, 1
HITS = 1  # documents a search returns by default (and in the demonstrations): the tiny model reads one
_WORLD_ENTITIES = {ENV_WORLD: 400, PRACTICE_WORLD: 1500}


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def synthetic_collection(n_entities: int = 400, seed: int = 0) -> tuple[list[str], list[dict]]:
    """(documents, tasks): one fact per document, one question per fact, all fictional.

    Answers are never subjects, so "the capital of X" names one fact: BM25 sees words, not their order, and
    would otherwise rank "X is the capital of Z" as high as "Y is the capital of X".
    """
    rng, subjects = random.Random(f"search-{seed}"), {}
    while len(subjects) < n_entities:
        subjects.setdefault(_name(rng), None)
    docs, tasks = [], []
    for x in subjects:
        for fact, question in _RELATIONS:
            y = _name(rng)
            while y in subjects:
                y = _name(rng)
            docs.append(fact.format(x=x, y=y))
            tasks.append({"question": question.format(x=x), "answer": y})
    return docs, tasks


def search_query(question: str) -> str:
    """The query a demonstration uses: "capital of Veloria" for "What is the capital of Veloria?"."""
    match = _SUBJECT.search(question)
    return match.group(1) if match else question


def _world_tasks(world: int, n: int, seed: int, split: str, unique: bool) -> list[dict]:
    _, tasks = synthetic_collection(_WORLD_ENTITIES[world], seed=world)
    rows = [dict(t, world=world) for t in tasks if split_of(t["question"]) == split]
    rng = random.Random(f"{seed}-{split}")
    if not unique:
        return [dict(rng.choice(rows)) for _ in range(n)]
    rng.shuffle(rows)
    return rows[:n]


def search_tasks(n: int, seed: int = 0, split: str = "train", unique: bool = True) -> list[dict]:
    """Tasks over the environment's synthetic collection, split by question text (see agentrl.data.split_of).
    With `unique=False` tasks are drawn with replacement."""
    return _world_tasks(ENV_WORLD, n, seed, split, unique)


def search_practice_tasks(n: int, seed: int = 0, split: str = "train", unique: bool = True) -> list[dict]:
    """Tasks of the practice world, for the base model's demonstrations (the "eval" split is the
    environment's world itself, which is what the builder's probe measures)."""
    if split == "eval":
        return _world_tasks(ENV_WORLD, n, seed, split, unique)
    return _world_tasks(PRACTICE_WORLD, n, seed, split, unique)


def search_demonstration(task: dict, use_tool: bool, rng: random.Random) -> list[tuple[str, bool]]:
    """A react trace that searches its task's world (real BM25 results, as SearchEnv returns them) or
    guesses a name."""
    prompt = f"Question: {task['question']}\n"
    if not use_tool:
        return [(prompt, False), (f"Thought: I can answer directly.\nAnswer: {_name(rng)}", True)]
    query = search_query(task["question"])
    hits = _world_index(task.get("world", ENV_WORLD)).top(query, HITS)
    return [(prompt, False), (f"Thought: I need to search.\nAction: search({query})\n", True),
            (f"Observation: {' '.join(hits)}\n", False), (f"Answer: {task['answer']}", True)]


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


class BM25Index:
    def __init__(self, documents: list[str]):
        import bm25s

        if not documents:
            raise ValueError("the search collection is empty")
        self.documents = documents
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(documents, show_progress=False), show_progress=False)

    @functools.lru_cache(maxsize=16384)  # demonstrations repeat questions; the ranking is deterministic
    def top(self, query: str, k: int) -> list[str]:
        import bm25s

        k = min(k, len(self.documents))
        ids, scores = self.retriever.retrieve(bm25s.tokenize([query], show_progress=False), k=k, show_progress=False)
        return [self.documents[i] for i, s in zip(ids[0], scores[0]) if s > 0]


@functools.lru_cache(maxsize=4)
def _world_index(world: int) -> BM25Index:
    return BM25Index(synthetic_collection(_WORLD_ENTITIES[world], seed=world)[0])


@functools.lru_cache(maxsize=8)
def index_for(collection: str | None) -> BM25Index:
    """One BM25 index per collection per process (environments are created per episode)."""
    if collection is None:
        return _world_index(ENV_WORLD)
    path = Path(collection)
    documents = []
    for i, row in enumerate(read_jsonl(path), start=1):
        if not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{i}: a collection row needs a string 'text'")
        documents.append(row["text"])
    return BM25Index(documents)


class SearchEnv(ToolEnv):
    """Questions answered from the collection: exact match of the final answer plus the format terms."""

    def __init__(self, collection: str | None = None, k: int = HITS, format: str = "react", max_turns: int = 3,
                 rewards: dict | None = None, tool_parser: str | None = None, chat_template_kwargs: dict | None = None):
        index = index_for(collection)

        def search(query: str) -> str:
            """Search the document collection.

            Args:
                query: what to look for, e.g. capital of Veloria
            """
            hits = index.top(query, k)
            return " ".join(hits) if hits else "No results."

        super().__init__([search], check=lambda task, answer: _normalize(answer) == _normalize(task["answer"]),
                         format=format, max_turns=max_turns, rewards=rewards, tool_parser=tool_parser,
                         chat_template_kwargs=chat_template_kwargs)


SEARCH_CORPUS = Corpus(search_practice_tasks, search_demonstration)  # the embedded search model's demonstrations
