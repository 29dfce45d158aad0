"""SFT rows -> token ids and labels: segments as the ReAct rollout builds them, chats as the chat rollout
renders them (assistant-only loss), and bad rows named by file, line and field."""

import json

import pytest

from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE
from agentrl.models.tiny import build_tokenizer
from agentrl.trainers.sft import DemonstrationDataError, encode_demonstrations, read_demonstrations

TEXTS = ["Question: What is 12 * 3?\nThought: I need to calculate 12 * 3.\nAction: calculator(12 * 3)\n"
         "Observation: 36\nAnswer: 36", "user\nassistant\ntool\nsystem\nTools: calculator(expression)\n"
         '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>The answer is 36']


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS * 20, 400)


@pytest.fixture(scope="module")
def chat_tok():
    return build_tokenizer(TEXTS * 20, 400, ("<|im_start|>", "<|im_end|>"), CHATML_TOOLS_TEMPLATE)


def encode(rows, tokenizer, **kw):
    return encode_demonstrations(read_demonstrations(rows), tokenizer, **kw)


def trained_text(tokenizer, ids, labels):
    return tokenizer.decode([i for i, label in zip(ids, labels) if label != -100])


def test_segments_are_tokenized_piece_by_piece_after_bos_and_end_with_eos(tok):
    segments = [["Question: What is 12 * 3?\n", False], ["Thought: I need to calculate 12 * 3.\nAction: calculator(12 * 3)\n", True],
                ["Observation: 36\n", False], ["Answer: 36", True]]
    (ids, labels), = encode([{"segments": segments}], tok)[0]
    pieces = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in segments]
    assert ids == [tok.bos_token_id] + sum(pieces, []) + [tok.eos_token_id]
    assert labels == [-100] + [-100] * len(pieces[0]) + pieces[1] + [-100] * len(pieces[2]) + pieces[3] + [tok.eos_token_id]
    # a bare list of pairs and {"text", "trainable"} objects read the same
    assert encode([segments], tok)[0][0] == (ids, labels)
    objects = [{"text": t, "trainable": f} for t, f in segments]
    assert encode([{"segments": objects}], tok)[0][0] == (ids, labels)


def test_chat_rows_train_only_what_the_assistant_writes(chat_tok):
    from agentrl.envs.calculator import CalculatorToolEnv
    from agentrl.rollout.engine import encode_prompt

    tools = CalculatorToolEnv().schemas
    row = {"tools": tools, "messages": [
        {"role": "user", "content": "What is 12 * 3?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 3"}}}]},
        {"role": "tool", "content": "36"},
        {"role": "assistant", "content": "The answer is 36"}]}
    (ids, labels), = encode([row], chat_tok)[0]
    # the ids are the template's rendering of the conversation, the prompt encoded as the rollout encodes it
    messages = [row["messages"][0], {**row["messages"][1], "content": ""}, *row["messages"][2:]]
    prompt = chat_tok.apply_chat_template(messages[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ids[:len(encode_prompt(chat_tok, prompt))] == encode_prompt(chat_tok, prompt)
    rendered = chat_tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert chat_tok.decode(ids[1:]) == rendered.removesuffix("\n")  # the episode ends at the turn end
    # trained: the two assistant turns (the call as the template renders it) with their turn-end markers;
    # not the tool result, not the scaffolding
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>'
    assert trained_text(chat_tok, ids, labels) == f"{call}<|im_end|>The answer is 36<|im_end|>"


def test_chat_rows_without_a_template_read_as_react_text(tok):
    row = {"messages": [{"role": "user", "content": "Question: What is 12 * 3?\n"},
                        {"role": "assistant", "content": "Action: calculator(12 * 3)\n"},
                        {"role": "tool", "content": "Observation: 36\n"}, {"role": "assistant", "content": "Answer: 36"}]}
    (ids, labels), = encode([row], tok)[0]
    assert trained_text(tok, ids, labels) == "Action: calculator(12 * 3)\nAnswer: 36" + tok.eos_token


@pytest.mark.parametrize("row, message", [
    ({"segments": [["Q\n", False], ["A", "yes"]]}, "field 'segments' item 1 must be [text, trainable]"),
    ({"segments": [["Q\n", False]]}, "field 'segments' has no trainable text"),
    ({"messages": [{"role": "user", "content": "Q"}]}, "field 'messages' has no assistant message"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "A"}]}, "field 'messages' item 0 needs a string 'content'"),
    ({"prompt": "Q", "completion": "A"}, "expected an object with a 'segments' or a 'messages' field"),
])
def test_bad_rows_name_file_line_and_field(tok, tmp_path, row, message):
    path = tmp_path / "demos.jsonl"
    good = {"segments": [["Q\n", False], ["A", True]]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")  # line 2 is blank: the bad row is line 3
    with pytest.raises(DemonstrationDataError, match=f"{path}:3: {message}".replace("[", r"\[").replace("]", r"\]")):
        encode(str(path), tok)
    examples, skipped, _ = encode(str(path), tok, skip_bad_rows=True)
    assert len(examples) == 1 and skipped == 1


def test_a_line_that_is_not_json_is_named_and_can_be_skipped(tok, tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text('{"segments": [["Q\\n", false], ["A", true]]}\n{"segments": [\n')
    with pytest.raises(DemonstrationDataError, match=f"{path}:2: not valid JSON"):
        encode(str(path), tok)
    assert encode(str(path), tok, skip_bad_rows=True)[1] == 1


def test_rows_that_do_not_split_as_the_rollouts_do_are_warned_about():
    import random
    import warnings

    from agentrl.envs import CalculatorEnv
    from agentrl.envs.calculator import calculator_demonstration, calculator_tasks
    from agentrl.jobs.common import check_demonstrations

    env, task = CalculatorEnv(), calculator_tasks(1)[0]
    good = calculator_demonstration(task, True, random.Random(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_demonstrations(env, [task], [{"segments": good}])
    with pytest.warns(UserWarning, match="is not reset"):
        check_demonstrations(env, [task], [[("Q: " + task["question"], False), *good[1:]]])
    merged = [good[0], ("".join(text for text, _ in good[1:]), True), ("", False)]
    with pytest.warns(UserWarning, match="runs past the stop pattern"):
        check_demonstrations(env, [task], [merged])


def _batches_of(examples, steps, **kw):
    from agentrl.trainers.sft import DemonstrationBatches

    batches = DemonstrationBatches(examples, 4, 0, seed=3, **kw)
    return [batches.next() for _ in range(steps)]


def test_length_grouped_batches_pad_less_and_still_draw_every_row_once_a_pass():
    import random

    rng = random.Random(0)
    # 30 rows (not a multiple of the batch of 4, so batches straddle passes), lengths 3-60, each id its row's index
    examples = [([k] * n, [k] * n) for k, n in enumerate(rng.randint(3, 60) for _ in range(30))]
    plain, grouped = _batches_of(examples, 30), _batches_of(examples, 30, group_by_length=True)
    assert sum(b["input_ids"].numel() for b in grouped) < 0.75 * sum(b["input_ids"].numel() for b in plain)

    drawn = [int(b["input_ids"][r, 0]) for b in grouped for r in range(len(b["input_ids"]))]
    assert sorted(drawn[:30]) == sorted(drawn[30:60]) == list(range(30))  # each pass: every row exactly once
    for b in grouped:  # rows and labels stay together; padding is padding
        for ids, labels, mask in zip(b["input_ids"], b["labels"], b["attention_mask"]):
            n = int(mask.sum())
            assert len(examples[int(ids[0])][0]) == n and (labels[:n] == ids[:n]).all() and (labels[n:] == -100).all()
    # After the pass's first batch (4 rows as they come), the other 26 rows of the pass form one window: sorted
    # by length and cut into 6 batches drawn in random order, then its 2 longest rows, which pass 2 completes.
    widths = [b["input_ids"].shape[1] for b in grouped[1:7]]
    assert widths != sorted(widths)
    lengths = [[len(examples[int(i)][0]) for i in b["input_ids"][:, 0]] for b in grouped[1:7]]
    window = sorted(len(examples[i][0]) for i in drawn[4:28])
    assert sum(sorted(lengths), []) == window  # each batch a contiguous run of the sorted window
    assert min(len(examples[i][0]) for i in drawn[28:30]) >= window[-1]
    in_order = _batches_of(examples, 7, group_by_length=True, shuffle=False)  # shuffle=False: in order of length
    assert [b["input_ids"].shape[1] for b in in_order[1:7]] == sorted(b["input_ids"].shape[1] for b in in_order[1:7])
    again = _batches_of(examples, 30, group_by_length=True)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(grouped, again))  # seeded
