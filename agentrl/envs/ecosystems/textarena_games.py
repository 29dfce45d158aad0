"""textarena's games (`pip install textarena`) as multi-turn agentrl environments.

    env:
      name: agentrl.envs.ecosystems.textarena_games:TextArenaEnv
      kwargs: {game: GuessTheNumber-v0-raw}
      tasks: agentrl.envs.ecosystems.textarena_games:textarena_tasks
      tasks_kwargs: {game: GuessTheNumber-v0-raw}

A task is a game seed. The prompt is what the game first tells the agent's player; each model turn ends after
its first bracketed move (`[5]`, the form textarena's games read), or at the chat template's turn end; the
game's new messages since then are the observation (only what is new: agentrl plays the unwrapped game, never
the wrappers that re-send the whole history). The episode score is the game's reward for the agent's player
when the game ends: for GuessTheNumber 1 for a win, else how close the last guess was. An invalid move is the
game's business (most allow one retry, then end the game) and is counted in info["invalid_moves"].
Two-player games play against `opponent`: "first" or "random" (a move from the list the game offers, e.g.
TicTacToe's "Available Moves: '[0]', '[1]'"), or "module:function" taking the opponent's new messages (str)
and returning its move.

textarena reseeds Python's global `random` in every reset and draws from it during play. Each environment keeps
the game's own random state and swaps it in around every call into textarena, so the caller's `random` is
untouched and a game depends on its seed alone.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import random
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.data import split_of
from agentrl.envs.base import StepResult, load_object
from agentrl.errors import UserError

MOVE = r"\[[^\[\]\n]*\]"  # a bracketed move: where a text-format turn ends
_RANDOM_LOCK = threading.RLock()  # one global `random`: one game's calls at a time swap it
_CHECKED: set = set()  # (game, kwargs, players) already reset once successfully in this process


class TextArenaError(UserError):
    """A game that cannot be played here: unknown id, nltk data it downloads at import missing, wrong players."""


def _textarena():
    """textarena, imported with the caller's global random state kept (its import draws from it)."""
    with _RANDOM_LOCK:
        state = random.getstate()
        try:
            import textarena
        except ImportError as e:
            raise TextArenaError(f"textarena games need textarena (pip install 'agentrl[ecosystems]'): {e}") from None
        finally:
            random.setstate(state)
    return textarena


def _registry() -> dict:
    return _textarena().envs.registration.ENV_REGISTRY


@functools.cache
def missing_downloads(game: str) -> tuple[str, ...]:
    """The nltk data packages `game`'s code downloads when imported (Wordle, Hangman, WordLadder, ...) and this
    machine does not have: read from its source, without importing it (the import would try the network)."""
    entry = _registry()[game].entry_point
    if not isinstance(entry, str):
        return ()
    root = Path(_textarena().__file__).parent
    module = entry.partition(":")[0].split(".")
    files = sorted(root.joinpath(*module[1:-1]).rglob("*.py"))  # the game's own package
    needed: set[str] = set()
    seen: set[Path] = set()
    while files:
        path = files.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        source = path.read_text(errors="replace")
        for call in re.findall(r"nltk\.download\(([^)]*)\)", source):
            needed |= set(re.findall(r"['\"]([\w.-]+)['\"]", call))
        # shared helpers it imports (envs/utils/word_lists.py downloads the word list)
        helpers = re.findall(r"textarena\.envs\.utils\.(\w+)", source)
        files += [root / "envs" / "utils" / f"{name}.py" for name in helpers]
    return tuple(sorted(name for name in needed if not _has_nltk_data(name)))


def _has_nltk_data(name: str) -> bool:
    try:
        import nltk
    except ImportError:
        return False
    for kind in ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment", "stemmers"):
        try:
            nltk.data.find(f"{kind}/{name}")
            return True
        except LookupError:
            continue
    return False


# --- opponents of two-player games --------------------------------------------------------------------------

_LISTED = re.compile(r"(?:available|valid|legal)[ _]moves?\s*(?:are|:)?\s*(.*)", re.IGNORECASE | re.DOTALL)


def listed_moves(observation: str) -> list[str]:
    """The bracketed moves the game lists last ("Available Moves: '[0]', '[1]'"); else every bracketed token."""
    found = list(_LISTED.finditer(observation))
    text = found[-1].group(1).split("\n\n")[0] if found else observation
    return re.findall(MOVE, text)


def first_move(observation: str) -> str:
    """A fixed opponent: the first move the game lists (empty, so invalid, when it lists none)."""
    moves = listed_moves(observation)
    return moves[0] if moves else ""


class RandomMove:
    """A seeded opponent: a uniformly random listed move, from its own generator (one per game)."""

    def __init__(self, seed: str):
        self.rng = random.Random(seed)

    def __call__(self, observation: str) -> str:
        moves = listed_moves(observation)
        return self.rng.choice(moves) if moves else ""


# --- the environment ---------------------------------------------------------------------------------------------

class TextArenaEnv:
    """One textarena game per episode (tasks: textarena_tasks). format "text": the game's messages as plain text,
    a turn ends after its first `[move]`; format "chat": the game's messages as user turns of the tokenizer's
    chat template, a turn ends at the template's turn end. `game_kwargs` go to the game's constructor (e.g.
    GuessTheNumber's min_number, max_number, max_turns). `max_turns` bounds the model's turns, retries after
    invalid moves included (default: twice the game's own turn limit, else 30); a game still running then
    scores 0 and is marked info["unfinished"]. `prompt` replaces the game's own opening text (its rules, ~130
    tokens for GuessTheNumber) by yours, e.g. a short one for a small model; the game's other messages stay."""

    def __init__(self, game: str = "GuessTheNumber-v0-raw", format: str = "text", opponent: str | None = None,
                 player: int = 0, max_turns: int | None = None, game_kwargs: dict | None = None,
                 prompt: str | None = None):
        if format not in ("text", "chat"):
            raise ValueError(f"format must be 'text' or 'chat', got {format!r}")
        registry = _registry()
        if game not in registry:
            near = difflib.get_close_matches(game, list(registry), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise TextArenaError(f"textarena has no game {game!r}{hint}")
        missing = missing_downloads(game)
        if missing:
            raise TextArenaError(f"textarena game {game!r} needs nltk data that is not on this machine "
                                 f"({', '.join(missing)}) and downloads it when imported; offline it cannot run. "
                                 f"Install it first: python -m nltk.downloader {' '.join(missing)}")
        self.game_id, self.format, self.player, self.prompt = game, format, player, prompt
        self.game_kwargs = dict(game_kwargs or {})
        self.num_players = 1 if opponent is None else 2
        if player not in range(self.num_players):
            raise ValueError(f"player must be one of {list(range(self.num_players))} with opponent={opponent!r}, "
                             f"got {player!r}")
        self.opponent_spec = opponent
        self._opponent: Callable[[str], str] | None = None
        if opponent not in (None, "first", "random"):
            self._opponent = load_object(opponent)
        self._random_state = None  # the game's own global-random state, swapped in around its calls
        try:  # textarena 0.7.4: some games' code needs Python 3.12, some an OpenRouter key, some missing files
            with self._game_random():
                self.game = _unwrapped(_textarena().make(game, **self.game_kwargs))
        except Exception as e:  # noqa: BLE001 - whatever the game's code raises becomes one line naming the game
            raise TextArenaError(f"textarena game {game!r} cannot be built here: {type(e).__name__}: {e}"[:500]
                                 ) from None
        self.max_turns = max_turns or 2 * int(getattr(self.game, "max_turns", 0) or 15)
        self.stop_patterns: tuple[str, ...] = (MOVE,) if format == "text" else ()
        self.keep_special_tokens = format == "chat"  # chat turns are read with their turn-end marker
        self.chat = None
        key = (game, repr(sorted(self.game_kwargs.items())), self.num_players)
        if key not in _CHECKED:  # a game of the wrong player count fails here, at construction, not mid-rollout
            try:
                self._reset_game(0)
            except TextArenaError:
                raise
            except Exception as e:  # noqa: BLE001 - as above
                raise TextArenaError(f"textarena game {game!r} cannot be reset here: {type(e).__name__}: {e}"[:500]
                                     ) from None
            _CHECKED.add(key)

    def bind_tokenizer(self, tokenizer) -> None:
        """Called by the rollout engine: chat format renders through the tokenizer's template."""
        if self.format == "chat":
            from agentrl.envs.chat import ChatRenderer

            self.chat = ChatRenderer.for_tokenizer(tokenizer, [])
            self.stop_patterns = (self.chat.stop_pattern,)
            self.eos_ends_episode = tokenizer.eos_token not in self.chat.turn_ends

    @property
    def messages(self) -> list[dict] | None:
        return self.chat.messages if self.chat is not None else None

    def reset(self, task: dict) -> str:
        for key, mine in (("game", self.game_id), ("game_kwargs", self.game_kwargs), ("prompt", self.prompt)):
            if key in task and task[key] != mine:
                raise ValueError(f"task {task.get('question')!r} is for {key}={task[key]!r}, this environment plays "
                                 f"{key}={mine!r} (set env.kwargs and env.tasks_kwargs alike)")
        if "seed" not in task:
            raise KeyError(f"textarena task needs a 'seed', got keys {sorted(task)}")
        self.turns = self.invalid_moves = self.opponent_invalid_moves = 0
        self.finished = False
        self._reset_game(int(task["seed"]))
        if self.num_players == 2:
            self._opponent_move = self._opponent or (RandomMove(f"{self.game_id}-{task['seed']}-opponent")
                                                     if self.opponent_spec == "random" else first_move)
        done = self._play_opponent()
        if done:
            raise TextArenaError(f"{self.game_id} seed {task['seed']}: the game ended before the agent's first move")
        messages = self._observe()
        if self.prompt is not None:
            ta = _textarena()
            messages = [(ta.GAME_ID, self.prompt, ta.ObservationType.PROMPT)] + [
                m for m in messages if m[2] != ta.ObservationType.PROMPT]
        text = self._render(messages)
        if self.format == "text":
            return text + "\n"
        if self.chat is None:
            raise RuntimeError("chat format needs bind_tokenizer(tokenizer) before reset()")
        return self.chat.start([{"role": "user", "content": text}])

    def step(self, action: str) -> StepResult:
        self.turns += 1
        move = self.chat.content(action) if self.chat is not None else action
        with self._game_random():
            done, _ = self.game.step(move)
        if self._was_invalid():
            self.invalid_moves += 1
        done = done or self._play_opponent()
        if done or self.turns >= self.max_turns or (self.chat is not None and self.chat.ended_with_eos(action)):
            if self.chat is not None:  # the conversation keeps its last turn (preference rows are written from it)
                self.chat.messages.append({"role": "assistant", "content": move})
            return self._finish() if done else StepResult(None, 0.0, True, self._info(0.0, unfinished=True))
        text = self._render(self._observe())
        if self.chat is None:
            return StepResult("\n" + text + "\n", 0.0, False, self._info(None))
        observation = self.chat.tool_turn(action, {"role": "assistant", "content": move},
                                          [{"role": "user", "content": text}])
        return StepResult(observation, 0.0, False, self._info(None))

    # --- the game, its random state and its messages --------------------------------------------------------

    @contextlib.contextmanager
    def _game_random(self):
        """The caller's global random state out, the game's in; the other way round after."""
        with _RANDOM_LOCK:
            outer = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    def _reset_game(self, seed: int) -> None:
        with self._game_random():
            try:
                self.game.reset(num_players=self.num_players, seed=seed)
            except AssertionError as e:  # textarena's states assert their player count
                raise TextArenaError(f"{self.game_id} cannot be played by {self.num_players} player(s) ({e}); agentrl "
                                     f"plays games of 1 player (no opponent) or 2 (opponent=...)") from None

    def _observe(self) -> list:
        with self._game_random():
            _, messages = self.game.get_observation()
        return messages

    def _render(self, messages: list, viewer: int | None = None) -> str:
        """A player's new messages as text: the game's as `[GAME] ...`, the other player's moves as
        `[Player 1] ...`, the prompt as it is; the viewer's own moves are left out (they wrote them)."""
        viewer = self.player if viewer is None else viewer
        ta = _textarena()
        lines = []
        for sender, message, kind in messages:
            if sender == viewer and kind == ta.ObservationType.PLAYER_ACTION:
                continue
            if kind == ta.ObservationType.PROMPT:
                lines.append(message.strip("\n"))
            elif sender == ta.GAME_ID:
                lines.append(f"[GAME] {message}")
            else:
                lines.append(f"[Player {sender}] {message}")
        return "\n".join(lines)

    def _was_invalid(self) -> bool:
        """The move just made was invalid: the state kept its error count (a retry is allowed) or the game
        ended on it (textarena's invalid_move flag)."""
        state = self.game.state
        ended = state.done and state.game_info.get(state.current_player_id, {}).get("invalid_move", False)
        return bool(getattr(state, "error_count", 0) > 0 or ended)

    def _play_opponent(self) -> bool:
        """The opponent's moves until it is the agent's turn again; True when the game is over."""
        for _ in range(1000):
            if self.game.state.done:
                return True
            if self.game.state.current_player_id == self.player:
                return False
            player = self.game.state.current_player_id
            messages = self._observe()
            move = self._opponent_move(self._render(messages, viewer=player))
            with self._game_random():
                done, _ = self.game.step(str(move))
            self.opponent_invalid_moves += self._was_invalid()
            if done:
                return True
        raise TextArenaError(f"{self.game_id}: the opponent made 1000 moves in a row without the game ending")

    def _finish(self) -> StepResult:
        with self._game_random():
            rewards, game_info = self.game.close()
        reward = float((rewards or {}).get(self.player, 0.0))
        self.finished = True
        reason = (game_info or {}).get(self.player, {}).get("reason")
        return StepResult(None, reward, True, self._info(reward, reason=reason))

    def _info(self, reward: float | None, unfinished: bool = False, reason: str | None = None) -> dict:
        won = reward is not None and reward >= 1.0  # textarena's win: 1 (two-player losers -1, draws 0)
        info = {"correct": won, "won": won, "game_reward": reward, "game_turns": self.game.state.turn,
                "invalid_moves": self.invalid_moves, "format_errors": self.invalid_moves,
                "unfinished": unfinished, "reason": reason}
        if self.num_players == 2:
            info["opponent_invalid_moves"] = self.opponent_invalid_moves
        return info


def _unwrapped(env):
    """The game itself under textarena's wrappers (agentrl renders the messages itself, only the new ones)."""
    ta = _textarena()
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


# --- tasks and demonstrations ---------------------------------------------------------------------------------

def textarena_tasks(n: int, seed: int = 0, split: str = "train", game: str = "GuessTheNumber-v0-raw",
                    game_kwargs: dict | None = None, prompt: str | None = None) -> list[dict]:
    """`n` distinct game seeds of `split`: a seed belongs to "train" or "eval" by a hash of the game id and the
    seed (agentrl.data.split_of), so the splits never overlap and are the same on every run and machine.
    `game_kwargs` and `prompt` ride along for the demonstrations (TextArenaEnv.reset checks they are its own)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng, tasks, seen = random.Random(f"textarena-{game}-{seed}-{split}"), [], set()
    while len(tasks) < n:
        game_seed = rng.randrange(2**31)
        question = f"{game} seed {game_seed}"
        if game_seed in seen or split_of(question) != split:
            continue
        seen.add(game_seed)
        tasks.append({"question": question, "game": game, "seed": game_seed,
                      **({"game_kwargs": dict(game_kwargs)} if game_kwargs else {}),
                      **({"prompt": prompt} if prompt is not None else {})})
    return tasks


GOOD_MOVE_SHARE = 0.4  # demonstrations: share of GuessTheNumber moves that halve the range (the rest take its low end)


def guess_the_number_moves(task: dict, rng: random.Random,
                           good_share: float = GOOD_MOVE_SHARE) -> list[tuple[str, str]]:
    """A scripted GuessTheNumber player's game on `task`: [(turn text, observation after it)], the last with an
    empty observation. Each turn writes the range the hints leave, then a guess: its middle with probability
    `good_share` (binary search: always wins in ceil(log2(n + 1)) turns), else its low end (a linear search,
    which runs out of turns on high numbers), so RL has a better move to find."""
    env = _player_env(task)
    env.reset(task)
    low, high = env.game.min_number, env.game.max_number
    moves = []
    while True:
        guess = (low + high) // 2 if rng.random() < good_share else low
        result = env.step(f"Range {low}-{high}: [{guess}]")
        moves.append((f"Range {low}-{high}: [{guess}]", result.observation or ""))
        if result.done:
            return moves
        if "higher" in result.observation:
            low = guess + 1
        elif "lower" in result.observation:
            high = guess - 1


_PLAYER_ENVS: dict = {}  # one text-format environment per game and kwargs, reset for each demonstration


def _player_env(task: dict) -> TextArenaEnv:
    key = (task["game"], repr(sorted((task.get("game_kwargs") or {}).items())), task.get("prompt"))
    if key not in _PLAYER_ENVS:
        _PLAYER_ENVS[key] = TextArenaEnv(task["game"], game_kwargs=task.get("game_kwargs"), prompt=task.get("prompt"))
    return _PLAYER_ENVS[key]


def guess_the_number_demonstration(task: dict, rng: random.Random) -> dict:
    """One SFT row (text format), split where the rollout engine splits turns: reset(task), then each turn
    through its `[guess]` (trainable) and the game's answer (not trainable)."""
    prompt = _player_env(task).reset(task)
    segments: list[list[Any]] = [[prompt, False]]
    for turn, observation in guess_the_number_moves(task, rng):
        segments.append([turn, True])
        if observation:
            segments.append([observation, False])
    return {"segments": segments}
