"""What a second hostile sweep found: user code that still ended a job silently or with a traceback (an exit in
a property or in bind_tokenizer, BaseExceptions, an info dict the logs cannot hold), model-written JSON that
crashed the tool parsers, nonsense settings that trained, and report rows that crashed the report."""

import json
import sys

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.envs.base import StepResult, checked_step, env_option, load_object, make_env
from agentrl.envs.safe_eval import CalculatorError, safe_eval
from agentrl.envs.tools import (ToolEnv, parse_hermes_tool_calls, parse_llama3_json_tool_calls,
                                parse_mistral_tool_calls)
from agentrl.errors import EnvironmentContractError, SignalExit
from agentrl.rollout import SamplingParams, rollout
from fake_tokenizer import FakeTokenizer
from test_reliability_envs import Env, writes_answer  # the well-behaved environment and sampler


class Boom(BaseException):
    pass


def run(env_cls):
    return rollout(None, FakeTokenizer(), env_cls, [{"question": "1"}], SamplingParams(), sampler=writes_answer)


def exits(self, *args):
    sys.exit(0)


@pytest.mark.parametrize("member", ["bind_tokenizer", "stop_patterns", "max_turns", "step_timeout", "messages",
                                    "eos_ends_episode"])
def test_an_exit_in_any_member_the_engine_reads_is_an_error_naming_it(member):
    value = exits if member == "bind_tokenizer" else property(exits)
    env_cls = type("ExitEnv", (Env,), {member: value})
    with pytest.raises(EnvironmentContractError, match=rf"ExitEnv\.{member}.* raised SystemExit"):
        run(env_cls)


@pytest.mark.parametrize("error", [KeyboardInterrupt, GeneratorExit, Boom, RuntimeError])
def test_base_exceptions_from_step_and_the_constructor_are_named(error):
    def raise_it(self, *args):
        raise error("x")

    with pytest.raises(EnvironmentContractError, match=rf"StepEnv\.step raised {error.__name__}"):
        run(type("StepEnv", (Env,), {"step": raise_it}))
    with pytest.raises(EnvironmentContractError, match=rf"InitEnv\(\*\*\{{\}}\) raised {error.__name__}"):
        make_env(type("InitEnv", (Env,), {"__init__": raise_it}))


def test_a_stop_signal_still_passes_through_env_option():
    env = type("Stopping", (Env,), {"step_timeout": property(lambda self: (_ for _ in ()).throw(SignalExit(143)))})()
    with pytest.raises(SignalExit):
        env_option(env, "step_timeout")


@pytest.mark.parametrize("info, message", [
    ({(1, 2): 3}, r"cannot be written as JSON \(info has the key tuple \(1, 2\)"),
    ({"a": [0, {"b": {None: 1, (3,): 2}}]}, r"info\['a'\]\[1\]\['b'\] has the key tuple \(3,\)"),
    ({"correct": "no"}, r"info\['correct'\] is str 'no'"),
    ({"tool_calls": "3"}, r"info\['tool_calls'\] is str '3'"),
])
def test_an_info_the_logs_cannot_hold_is_named(info, message):
    env = type("InfoEnv", (Env,), {"step": lambda self, a: StepResult(None, 1.0, True, info)})()
    with pytest.raises(EnvironmentContractError, match=rf"InfoEnv\.step must return .*{message}"):
        checked_step(env, "Answer: 1")


def test_a_cyclic_info_is_named():
    info = {}
    info["x"] = [1, info]
    env = type("CycleEnv", (Env,), {"step": lambda self, a: StepResult(None, 1.0, True, info)})()
    with pytest.raises(EnvironmentContractError, match=r"cannot be written as JSON \(info\['x'\]\[1\] contains itself"):
        checked_step(env, "Answer: 1")


def test_the_cli_never_exits_0_when_user_code_calls_sys_exit(monkeypatch, capsys):
    import agentrl.cli as cli

    def job(args):
        sys.exit(0)

    monkeypatch.setattr(cli, "_cmd_report", job)
    assert cli.main(["report", "somewhere"]) == 2
    assert "sys.exit(0) was called inside the job" in capsys.readouterr().err


DEEP = "[" * 5000 + "]" * 5000


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
    """
    return str(safe_eval(expression))


@pytest.mark.parametrize("parse, text", [
    (parse_hermes_tool_calls, '<tool_call>{"name": "c", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>"),
    (parse_hermes_tool_calls, '<tool_call>{"name": "c", "arguments": ' + DEEP + "}</tool_call>"),
    (parse_mistral_tool_calls, "[TOOL_CALLS]" + DEEP),
    (parse_llama3_json_tool_calls, '{"name": "c", "parameters": ' + DEEP + "}"),
])
def test_model_written_json_past_the_decoders_limits_is_a_malformed_call(parse, text):
    calls, errors = parse(text)
    assert calls == [] and len(errors) == 1 and "not valid JSON" in errors[0]


def test_deep_react_arguments_and_an_unprintable_result_are_observations():
    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

    def odd(x: str) -> dict:
        """A tool whose result cannot be shown.

        Args:
            x: anything
        """
        return {"a": Unprintable()}

    env = ToolEnv([calculator, odd], check=lambda task, answer: True)
    env.reset({"question": "q"})
    assert "nested too deeply" in env.step('Action: calculator({"expression": ' + DEEP + "})\n").observation
    assert "odd returned a dict that is not JSON" in env.step("Action: odd(1)\n").observation


def test_a_newline_in_a_calculator_expression_is_a_calculator_error():
    with pytest.raises(CalculatorError, match="not allowed"):
        safe_eval("1\n+1")


@pytest.mark.parametrize("override, message", [
    ("ppo.max_grad_norm=-1", "max_grad_norm: must be >= 0"),
    ("ppo.adam_eps=0", "adam_eps: must be > 0"),
    ("ppo.seed=-1", r"seed: must be in \[0, 2\*\*32\)"),
    ("eval_seed=99999999999", "eval_seed: must be in"),
    ("sft.weight_decay=-5", "weight_decay: must be >= 0"),
    ("sft.warmup_steps=-3", "warmup_steps: must be >= 0"),
])
def test_settings_that_would_train_backwards_or_crash_later_are_refused(override, message):
    from agentrl.jobs.ppo import JobConfig

    with pytest.raises(ConfigError, match=message):
        load_config(JobConfig, None, [override])


def test_config_files_that_are_not_text_or_not_names_are_one_line(tmp_path):
    from agentrl.jobs.ppo import JobConfig

    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("out_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(JobConfig, binary)
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text("1: 2\n")
    with pytest.raises(ConfigError, match="keys are names"):
        load_config(JobConfig, numbered)


def test_unknown_lora_targets_are_named_before_peft_runs():
    from transformers import GPT2Config, GPT2LMHeadModel

    from agentrl.jobs.common import ModelSection, add_lora

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ConfigError, match=r"model.target_modules: \['q_proj'\] not among GPT2LMHeadModel's"):
        add_lora(model, ModelSection(lora=True, target_modules=["q_proj"], train_norms=False))
    assert add_lora(model, ModelSection(lora=True, target_modules=["c_attn"], train_norms=False)) is not None


def test_the_working_directory_leaves_sys_path_after_the_users_module_imports(tmp_path, monkeypatch):
    (tmp_path / "usermod_sweep.py").write_text("VALUE = 3\n")
    monkeypatch.chdir(tmp_path)
    assert load_object("usermod_sweep:VALUE") == 3
    assert str(tmp_path) not in sys.path


def test_the_report_skips_rows_it_cannot_draw(tmp_path):
    from agentrl.jobs.report import load_run

    rows = [{"kind": "episode", "step": 1, "logprobs": [None, -1.0], "trainer_logprobs": [None, "x"]},
            {"kind": "<b>pair</b>"}, {"kind": "episode", "step": [1]},
            {"kind": "episode", "step": 2, "logprobs": [-1.0], "trainer_logprobs": [-1.5]}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 1.0}) + "\n")
    with pytest.warns(UserWarning, match="row 1 skipped"):
        run = load_run(tmp_path)
    assert [s["step"] for s in run["samples"]] == [2] and run["metrics"][0]["rollout/logprob_mismatch_mean"] == 0.5


def test_one_huge_row_does_not_stall_the_embedded_tokenizer():
    """BPE training is quadratic in a word's length: a 2 MB row took hours before the cap (0.03 s now)."""
    import threading

    from agentrl.models.tiny import build_tokenizer

    built = []
    worker = threading.Thread(target=lambda: built.append(build_tokenizer(["A" * 2_000_000, "Question: 1 + 2"], 300)),
                              daemon=True)
    worker.start()
    worker.join(60)
    assert built, "building a tokenizer over one 2 MB row did not finish in 60 s"


def test_an_unknown_tracker_is_named_at_the_config():
    from agentrl.jobs.ppo import JobConfig

    for section in ("ppo", "grpo"):
        with pytest.raises(ConfigError, match=f"{section}.log_with: 'nonsense' is not one of accelerate's trackers"):
            load_config(JobConfig, None, [f"{section}.log_with=nonsense"])
    assert load_config(JobConfig, None, ["ppo.log_with=tensorboard"]).ppo.log_with == "tensorboard"


@pytest.mark.parametrize("prompt", [[{"role": "user"}], [], [{"role": "user", "content": 3}]])
def test_a_pairs_prompt_message_without_content_is_named(prompt):
    from agentrl.preferences import PreferenceDataError, tokenize_row

    from fake_tokenizer import FakeTokenizer as Tok

    row = {"prompt": prompt, "chosen": "Answer: 1", "rejected": "Answer: 2"}
    with pytest.raises(PreferenceDataError, match=r"pairs.jsonl line 1: field 'prompt'"):
        tokenize_row(row, Tok(), "pairs.jsonl line 1", max_length=64, max_prompt_length=32)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    from agentrl.jobs.ppo import JobConfig

    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("env:\n  tasks_kwargs:\n" + "".join(f"    {line}\n" for line in lines))
    with pytest.raises(ConfigError, match="alias bomb"):
        load_config(JobConfig, bomb)


def test_a_str_subclass_result_that_breaks_len_is_shown_as_text():
    from agentrl.envs.tools import ToolCall, ToolRunner

    class Odd(str):
        def __len__(self):
            raise RuntimeError("len boom")

    def odd(x: str) -> str:
        """A tool returning a str subclass.

        Args:
            x: anything
        """
        return Odd("hi")

    assert ToolRunner([odd], timeout=3)(ToolCall("odd", {"x": "1"})) == ("hi", True)


def test_a_run_whose_sample_rows_are_all_skipped_still_reports(tmp_path):
    from agentrl.jobs.report import load_run

    row = {"kind": "episode", "step": 1, "trainer_logprobs": [-1.0]}
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.warns(UserWarning, match="row 1 skipped"):
        assert load_run(tmp_path)["samples"] == []


@pytest.mark.parametrize("override, message", [("out_dir=", "out_dir: must name a directory"),
                                               ("model.builder.hidden_size=-1", "hidden_size: must be >= 1"),
                                               ("model.builder.steps=0", "model.builder.steps: must be >= 1"),
                                               ("model.builder.tool_fraction=2", r"tool_fraction: must be in \[0, 1\]")])
def test_an_empty_out_dir_and_bad_builder_settings_are_refused(override, message):
    from agentrl.jobs.ppo import JobConfig

    with pytest.raises(ConfigError, match=message):
        load_config(JobConfig, None, [override])


@pytest.mark.parametrize("typo", ["pairs.json", "data/pairs.csv", "./pairs", "/no/such/pairs"])
def test_a_pairs_path_typo_is_named_without_asking_the_hub(typo, tmp_path, monkeypatch):
    import datasets

    from agentrl.preferences import PreferenceDataError, read_preference_rows

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(PreferenceDataError, match=rf"^{typo}: no such file$"):
        read_preference_rows(typo)


def test_diverged_weights_stop_sampling_with_a_named_error():
    """A learning rate of 1e30 leaves weights whose logits overflow: sampling says so instead of torch.multinomial's
    'probability tensor contains either inf, nan' traceback, for sampled and greedy decoding alike."""
    import torch

    from agentrl.checkpoint import NonFiniteError
    from agentrl.rollout.sampling import sample_batch

    class Diverged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **kwargs):
            logits = torch.full((*input_ids.shape, 8), float("nan"))
            return type("Out", (), {"logits": logits, "past_key_values": None})()

    for do_sample in (True, False):
        with pytest.raises(NonFiniteError, match="logits hold NaN or inf"):
            sample_batch(Diverged(), [[1, 2, 3]], SamplingParams(max_new_tokens=2, do_sample=do_sample), 0, 0)


def test_a_second_signal_ends_a_step_that_never_ends_and_every_exit_says_why(tmp_path, capfd):
    """SIGTERM in a step asks for a checkpoint when the step ends; a step that hangs (no deadline) never ends, so
    a second SIGTERM exits at once. Both that exit and one outside a step print one line (they printed nothing)."""
    import os
    import signal

    from agentrl.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", every=2)
    with ckpt.signals(), ckpt.loop():
        os.kill(os.getpid(), signal.SIGTERM)  # the first one only asks
        assert ckpt.signal == signal.SIGTERM
        with pytest.raises(SignalExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 143
    assert "a second SIGTERM before the step ended" in capfd.readouterr().err
    with pytest.raises(SignalExit) as stopped, Checkpointer(tmp_path / "c2").signals():
        os.kill(os.getpid(), signal.SIGINT)
    assert stopped.value.code == 130 and "SIGINT outside a training step: exiting" in capfd.readouterr().err
