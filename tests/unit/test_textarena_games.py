"""textarena games through agentrl's rollout engine, offline, with scripted players (no model)."""

import random
import re
import sys
import warnings

import pytest

pytest.importorskip("textarena")

from agentrl.envs.ecosystems import textarena_games as tg
from agentrl.envs.ecosystems.textarena_games import (
    TextArenaEnv,
    TextArenaError,
    textarena_tasks,
)
from agentrl.rollout import SamplingParams, rollout
from agentrl.rollout.sampling import Sample

SMALL = {"min_number": 1, "max_number": 10, "max_turns": 4}


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded byte-level BPE, trained in a blink on a few game texts (any text encodes and decodes back)."""
    from agentrl.models.tiny import build_tokenizer

    env = TextArenaEnv()
    texts = [env.reset(t) for t in textarena_tasks(2)] + ["Range 1-20: [10]\n[GAME] The target number is lower."]
    return build_tokenizer(texts * 4, vocab_size=400)


def binary_search_sampler(contexts, params, eos_token_id, pad_token_id, tokenizer=None, stop_patterns=(),
                          generator=None):
    """A scripted policy in the sampler's place: it reads the whole episode so far (what the engine built from
    the game's messages) and writes the middle of the range the hints leave, as one `[guess]` turn."""
    samples = []
    for ids in contexts:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        low, high = map(int, re.search(r"between (\d+) and (\d+)", text).groups())
        for guess, hint in re.findall(r"\[(\d+)\]\n\[GAME\] The target number is (higher|lower)", text):
            low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
        move = tokenizer(f"Range {low}-{high}: [{(low + high) // 2}]", add_special_tokens=False)["input_ids"]
        samples.append(Sample(ids=move, logprobs=[0.0] * len(move), finish="stop"))
    return samples


@pytest.mark.parametrize("game_kwargs,turns", [(None, 5), (SMALL, 4)])  # ceil(log2(range + 1)) guesses
def test_binary_search_wins_every_game_through_the_rollout_engine(tokenizer, game_kwargs, turns):
    tasks = textarena_tasks(60, seed=0, split="eval", game_kwargs=game_kwargs)
    factory = lambda: TextArenaEnv(game_kwargs=game_kwargs)
    episodes = rollout(object(), tokenizer, factory, tasks, SamplingParams(max_new_tokens=16),
                       sampler=binary_search_sampler)
    assert len({ep.task["seed"] for ep in episodes}) == 60
    for ep in episodes:
        assert ep.info["won"] and ep.info["correct"] and ep.score == 1.0, ep.info
        assert ep.num_turns <= turns and ep.info["invalid_moves"] == 0
        text = tokenizer.decode(ep.token_ids)
        # only what is new each turn: the game's prompt is in the prompt ids, never appended again
        assert "Guess The Number" in tokenizer.decode(ep.prompt_ids) and "Guess The Number" not in text
        assert text.count("[GAME]") == ep.num_turns - 1  # one hint per turn before the winning one
        hints = [i for i, m in enumerate(ep.loss_mask) if m == 0]  # the game's messages: never trained on
        assert tokenizer.decode([ep.token_ids[i] for i in hints]).count("[GAME]") == ep.num_turns - 1
    assert max(ep.num_turns for ep in episodes) == turns  # some of the 60 numbers take binary search's worst case


def test_the_callers_random_state_is_untouched_and_a_game_depends_on_its_seed_alone():
    state = random.getstate()
    env = TextArenaEnv(game_kwargs=SMALL)
    task = textarena_tasks(1, split="eval", game_kwargs=SMALL)[0]
    env.reset(task)
    first = env.game.game_number
    for move in ("[1]", "[2]", "no move", "[3]"):
        env.step(move)
    assert random.getstate() == state
    random.seed(123)  # whatever the caller does with random, the same seed is the same game
    other = TextArenaEnv(game_kwargs=SMALL)
    random.random()
    other.reset(task)
    assert other.game.game_number == first


def test_an_invalid_move_is_the_games_retry_then_its_end_and_is_counted():
    env = TextArenaEnv(game_kwargs=SMALL)
    env.reset(textarena_tasks(1, split="eval", game_kwargs=SMALL)[0])
    target = env.game.game_number
    guess = 1 if target != 1 else 2
    first = env.step(f"[{guess}]")
    assert not first.done and first.info["invalid_moves"] == 0
    retry = env.step("I think it is five")  # no bracket: textarena allows one retry
    assert not retry.done and "invalid move" in retry.observation and retry.info["invalid_moves"] == 1
    again = env.step(f"[{guess}]")  # the same number again: invalid a second time in a row, the game ends
    assert again.done and again.info["invalid_moves"] == 2 and not again.info["won"]
    # the game's own reward for ending so: how close the last valid guess was
    assert again.reward == pytest.approx(1 - abs(guess - target) / 9)
    assert "Invalid Move" in again.info["reason"]


@pytest.mark.parametrize("game", ["Hangman-v0-raw", "Wordle-v0", "WordLadder-v0-raw"])
def test_games_that_download_nltk_data_fail_at_construction_in_one_line(game, monkeypatch):
    monkeypatch.setattr(tg, "_has_nltk_data", lambda name: False)  # whatever this machine has installed
    tg.missing_downloads.cache_clear()
    try:
        with pytest.raises(TextArenaError) as error:
            TextArenaEnv(game)
    finally:
        tg.missing_downloads.cache_clear()
    message = str(error.value)
    assert "\n" not in message and game in message and "words" in message and "nltk.downloader" in message
    module = tg._registry()[game].entry_point.partition(":")[0]
    assert module not in sys.modules  # refused from its source: never imported, so no download was tried


def test_offline_games_need_no_download_and_unknown_ids_are_named():
    assert tg.missing_downloads("GuessTheNumber-v0-raw") == () and tg.missing_downloads("TicTacToe-v0") == ()
    with pytest.raises(TextArenaError, match="GuessTheNumber-v0-raw"):
        TextArenaEnv("GuessTheNumbr-v0-raw")
    with pytest.raises(TextArenaError, match="1 player.*opponent=|2 player"):
        TextArenaEnv("TicTacToe-v0-raw")  # a two-player game without an opponent


def test_a_two_player_game_against_a_scripted_opponent(tmp_path, monkeypatch):
    env = TextArenaEnv("TicTacToe-v0-raw", opponent="first")  # the opponent takes the first free cell
    prompt = env.reset({"seed": 1})
    assert "Tic Tac Toe" in prompt and "Available Moves" in prompt
    step = env.step("[4]")
    assert "[Player 1] [0]" in step.observation and "[4]" not in step.observation.split("[Player 1]")[0].split(
        "cell 4")[0]  # the agent's own move is not echoed back; the opponent's is
    env.step("[3]")  # the opponent takes 1, then the agent completes the middle row
    last = env.step("[5]")
    assert last.done and last.reward == 1.0 and last.info["won"] and last.info["opponent_invalid_moves"] == 0

    # an opponent of the user's own, by "module:function"
    (tmp_path / "my_opponent.py").write_text("def corner(observation):\n    return '[8]' if '[8]' in observation "
                                             "else '[6]'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = TextArenaEnv("TicTacToe-v0-raw", opponent="my_opponent:corner")
    env.reset({"seed": 0})
    assert "[Player 1] [8]" in env.step("[0]").observation
    assert "[Player 1] [6]" in env.step("[1]").observation
    lost = env.step("[0]")  # occupied: invalid, the game's retry
    assert not lost.done and lost.info["invalid_moves"] == 1
    won = env.step("[2]")
    assert won.done and won.reward == 1.0

    def random_opponent_moves(seed):
        env = TextArenaEnv("TicTacToe-v0-raw", opponent="random")
        env.reset({"seed": seed})
        return [re.findall(r"\[Player 1\] (\[\d\])", env.step(f"[{cell}]").observation or "") for cell in (4, 3)]

    assert random_opponent_moves(7) == random_opponent_moves(7)  # seeded by the game's seed: reproducible
    assert len({str(random_opponent_moves(seed)) for seed in range(6)}) > 1  # and random across seeds

    second = TextArenaEnv("TicTacToe-v0-raw", opponent="first", player=1)  # the opponent opens
    assert "[Player 0] [0]" in second.reset({"seed": 0})
    with pytest.raises(ValueError, match="player"):
        TextArenaEnv(player=1)  # a single-player game has only player 0


def test_the_split_never_overlaps_and_is_the_same_on_every_run():
    train, held_out = textarena_tasks(500, seed=0, split="train"), textarena_tasks(200, seed=0, split="eval")
    assert not {t["seed"] for t in train} & {t["seed"] for t in held_out}
    assert len({t["seed"] for t in train}) == 500
    assert textarena_tasks(500, seed=0, split="train") == train  # identical when drawn again
    other = textarena_tasks(500, seed=1, split="eval")  # another draw seed: other games, still held out
    assert not {t["seed"] for t in other} & {t["seed"] for t in train}
    assert all(t["game_kwargs"] == SMALL for t in textarena_tasks(3, game_kwargs=SMALL))


def test_a_task_for_another_game_is_refused():
    env = TextArenaEnv(game_kwargs=SMALL)
    with pytest.raises(ValueError, match="game_kwargs"):
        env.reset(textarena_tasks(1)[0] | {"game_kwargs": {"max_number": 50}})


def test_demonstrations_split_as_rollouts_do_and_the_right_moves_always_win():
    from agentrl.jobs.common import check_demonstrations

    tasks = textarena_tasks(40, game_kwargs=SMALL)
    rows = [tg.guess_the_number_demonstration(t, random.Random(i)) for i, t in enumerate(tasks)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_demonstrations(TextArenaEnv(game_kwargs=SMALL), tasks, rows, k=40)
    for k, task in enumerate(tasks):
        moves, env = tg.guess_the_number_moves(task, random.Random(k), good_share=1.0), tg._player_env(task)
        assert len(moves) <= 4 and env.game.state.rewards == {0: 1}  # binary search: always a win
    lost = 0
    for k, task in enumerate(tasks):  # linear search runs out of guesses on high numbers
        moves, env = tg.guess_the_number_moves(task, random.Random(k), good_share=0.0), tg._player_env(task)
        lost += env.game.state.rewards[0] < 1
    assert 0 < lost < len(tasks)


def test_chat_format_appends_the_games_messages_as_user_turns_of_the_template():
    from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE
    from agentrl.models.tiny import build_tokenizer

    tok = build_tokenizer(["[5] higher lower"] * 4, 300, ("<|im_start|>", "<|im_end|>"), CHATML_TOOLS_TEMPLATE)
    env = TextArenaEnv(format="chat", game_kwargs=SMALL, prompt="Guess 1-10 in 4 turns.")
    env.bind_tokenizer(tok)
    assert env.stop_patterns == (re.escape("<|im_end|>"),)
    for task in textarena_tasks(20, game_kwargs=SMALL, prompt="Guess 1-10 in 4 turns."):
        prompt = env.reset(task)
        if env.game.game_number != 5:
            break
    assert prompt == "<|im_start|>user\nGuess 1-10 in 4 turns.<|im_end|>\n<|im_start|>assistant\n"
    hint = "higher" if env.game.game_number > 5 else "lower"
    step = env.step("I guess [5]<|im_end|>")
    assert step.observation == (f"\n<|im_start|>user\n[GAME] The target number is {hint}.<|im_end|>\n"
                                f"<|im_start|>assistant\n")
    last = env.step(f"[{env.game.game_number}]<|im_end|>")
    assert last.done and last.info["won"]
    assert [m["role"] for m in env.messages] == ["user", "assistant", "user", "assistant"]
    assert env.messages[1]["content"] == "I guess [5]"
