"""MCP servers' tools as ToolEnv tools, against the real stdio calculator server (a subprocess, offline): the
same ids, masks and rewards as the in-process calculator, every failure an observation within its timeout,
and no server process left behind."""

import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("mcp")

from agentrl.envs.calculator import CalculatorToolEnv, calculator, calculator_tasks, numeric_match  # noqa: E402
from agentrl.envs.ecosystems.mcp_tools import (MCPConnection, MCPServerError, MCPToolEnv,  # noqa: E402
                                              check_server_spec, close_servers)
from agentrl.envs.tools import ToolCall, tool_schema  # noqa: E402
from agentrl.rollout import SamplingParams, rollout  # noqa: E402

SERVER = {"command": "python", "args": ["-m", "agentrl.envs.ecosystems.mcp_calculator_server", "--test-tools"]}
CHECK = "agentrl.envs.calculator:numeric_match"


def server_processes(marker: str = "mcp_calculator_server") -> list[psutil.Process]:
    """This test process's children that run an MCP server (directly or through the PDEATHSIG launcher)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any(marker in part for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module", autouse=True)
def no_server_left():
    yield
    close_servers()
    assert server_processes() == []


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The chat corpus' tiny model, briefly trained: it writes well-formed calls, malformed ones and guesses."""
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    out = build_base_model(tmp_path_factory.mktemp("chat") / "model",
                           BaseModelConfig(corpus="chat", steps=120, batch_size=32, warmup_steps=10), progress=False)
    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def test_the_served_calculator_has_the_in_process_tools_schema():
    env = MCPToolEnv(server=SERVER, check=CHECK, allowed_tools=["calculator"])
    expected = tool_schema(calculator)
    expected["function"].pop("return", None)  # transformers' return entry is not part of a function-calling schema
    assert env.schemas == [expected]
    assert MCPToolEnv(server=SERVER, check=CHECK).runner.schemas.keys() == {"calculator", "hang", "crash", "die", "pid"}


def test_64_chat_episodes_have_the_same_ids_masks_and_rewards(chat_model):
    model, tok = chat_model
    tasks = calculator_tasks(64, seed=0, split="eval")
    params = SamplingParams(max_new_tokens=48, temperature=1.0)
    local = rollout(model, tok, lambda: CalculatorToolEnv(format="chat", max_turns=3), tasks, params,
                    generator=torch.Generator().manual_seed(0))
    served = rollout(model, tok, lambda: MCPToolEnv(server=SERVER, check=CHECK, allowed_tools=["calculator"],
                                                    format="chat", max_turns=3), tasks, params,
                     generator=torch.Generator().manual_seed(0))
    for a, b in zip(local, served, strict=True):
        assert (a.prompt_ids, a.token_ids, a.loss_mask, a.turn_ends) == (b.prompt_ids, b.token_ids, b.loss_mask, b.turn_ends)
        assert a.turn_rewards == b.turn_rewards and a.logprobs == b.logprobs
        assert a.messages == b.messages and a.info == b.info
    # Not vacuous: the model called the tool, well and badly, and observations were appended and masked.
    assert sum(ep.info["tool_calls"] > 0 for ep in served) >= 8
    assert sum(ep.info["correct"] for ep in served) >= 1
    assert any(0 in ep.loss_mask for ep in served)


def test_react_prompt_lists_the_tools_and_calls_go_to_the_server():
    env = MCPToolEnv(server=SERVER, check=numeric_match, format="react", allowed_tools=["calculator"])
    task = {"question": "What is 12 * 3?", "answer": "36"}
    assert env.reset(task) == ("Tools:\ncalculator(expression): Evaluate an arithmetic expression.\n"
                               "Question: What is 12 * 3?\n")
    assert env.step("Action: calculator(12 * 3)\n").observation == "Observation: 36\n"
    final = env.step("Answer: 36")
    assert final.done and final.reward == 1.0 and final.info["correct"]
    plain = MCPToolEnv(server=SERVER, check=numeric_match, format="react", react_tool_list=False)
    assert plain.reset(task) == CalculatorToolEnv(format="react").reset(task)


@pytest.mark.parametrize("call, observation, limit", [
    (ToolCall("search", {"q": "x"}), "Error: unknown tool 'search'; available: calculator, hang, crash, die, pid", 1.0),
    (ToolCall("calculator", {"expression": 5}), "Error: calculator: argument 'expression' must be string, got int", 1.0),
    (ToolCall("calculator", {}), "Error: calculator: missing argument 'expression'", 1.0),
    (ToolCall("calculator", {"expression": "1 / 0"}), "Error: calculator raised CalculatorError: division by zero", 3.0),
    (ToolCall("hang", {"seconds": 60}), "Error: hang timed out after 1.5 s", 3.0),
    (ToolCall("crash", {}), "Error: crash failed on the server (an unexpected exception; its message is in the "
                            "server's log)", 3.0),
    (ToolCall("hang", {"seconds": "long"}), "Error: hang: argument 'seconds' must be number, got str", 1.0),
])
def test_failures_are_observations_within_the_timeout(call, observation, limit):
    env = MCPToolEnv(server=SERVER, check=CHECK, timeout=1.5)
    started = time.monotonic()
    assert env.runner(call) == (observation, False)
    assert time.monotonic() - started < limit
    assert env.runner(ToolCall("calculator", {"expression": "6 * 7"})) == ("42", True)  # the server still serves


def test_a_server_error_the_schema_check_misses_is_the_servers_message():
    env = MCPToolEnv(server=SERVER, check=CHECK)
    text, ok = env.runner(ToolCall("hang", {"seconds": -1.0}))  # time.sleep(-1) raises ValueError: a crash
    assert not ok and text.startswith("Error: hang failed on the server")


def test_concurrent_calls_from_threads_share_one_session():
    env = MCPToolEnv(server=SERVER, check=CHECK)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: env.runner(ToolCall("calculator", {"expression": f"{i} * 3"})), range(64)))
    assert results == [(str(i * 3), True) for i in range(64)]
    assert len(server_processes()) == 1


def test_a_server_dying_mid_episode_is_an_observation_and_it_is_restarted():
    env = MCPToolEnv(server=SERVER, check=CHECK, format="chat", timeout=2.0)
    first_pid = int(env.runner(ToolCall("pid", {}))[0])
    started = time.monotonic()
    text, ok = env.runner(ToolCall("die", {}))
    assert not ok and "closed the connection" in text and time.monotonic() - started < 2.0
    with pytest.warns(UserWarning, match="restarting it"):
        text, ok = env.runner(ToolCall("calculator", {"expression": "1 + 1"}))  # restarting: an observation
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 60
    while (text, ok) != ("2", True) and time.monotonic() < deadline:  # the restarted server answers
        assert text.startswith("Error: calculator") or text == "2"
        time.sleep(0.5)
        text, ok = env.runner(ToolCall("calculator", {"expression": "1 + 1"}))
    assert (text, ok) == ("2", True)
    assert int(env.runner(ToolCall("pid", {}))[0]) != first_pid
    assert len(server_processes()) == 1


def test_a_server_whose_calls_keep_hanging_is_restarted():
    """Each hung call holds a server thread: after RESTART_AFTER_TIMEOUTS in a row the server is replaced."""
    env = MCPToolEnv(server={**SERVER, "env": {"AGENTRL_TEST": "hangs"}}, check=CHECK, timeout=0.5)
    first_pid = env.runner(ToolCall("pid", {}))[0]
    for _ in range(MCPConnection.RESTART_AFTER_TIMEOUTS):
        assert env.runner(ToolCall("hang", {"seconds": 60})) == ("Error: hang timed out after 0.5 s", False)
    time.sleep(1.5)  # the abandoned calls' own timeouts (the runner's answered first)
    with pytest.warns(UserWarning, match="4 calls in a row timed out; restarting it"):
        env.runner(ToolCall("pid", {}))
    deadline, text = time.monotonic() + 60, ""
    while not text.isdigit() and time.monotonic() < deadline:
        time.sleep(0.5)
        text, _ = env.runner(ToolCall("pid", {}))
    assert text.isdigit() and text != first_pid


def test_close_servers_leaves_no_process():
    MCPToolEnv(server={**SERVER, "env": {"AGENTRL_TEST": "close"}}, check=CHECK)
    assert len(server_processes()) >= 1
    close_servers()
    assert server_processes() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("end", ["exit", "SIGTERM", "SIGKILL"])
def test_no_server_outlives_its_run(end):
    """atexit stops the server on a normal exit; PR_SET_PDEATHSIG kills it when the run dies without atexit.
    A call hangs in the server meanwhile: a server whose stdin closes would otherwise wait for it (measured:
    with the SDK's stdio_client alone, the server outlives a SIGKILLed parent)."""
    script = textwrap.dedent(f"""
        import sys, threading, time
        from agentrl.envs.ecosystems.mcp_tools import mcp_client
        client = mcp_client({SERVER!r})
        print(client.call("pid", {{}}, 10.0), flush=True)
        threading.Thread(target=client.call, args=("hang", {{"seconds": 120}}, 300.0), daemon=True).start()
        time.sleep(1)
        if {end!r} == "exit":
            sys.exit(0)
        time.sleep(120)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(run.stdout.readline())
        assert psutil.pid_exists(server_pid)
        if end != "exit":
            run.send_signal(getattr(signal, end))
        run.wait(30)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(server_pid)
    finally:
        run.kill()
        run.wait()


def test_a_server_reached_at_a_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "agentrl.envs.ecosystems.mcp_calculator_server", "--http",
                               str(port)], stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}/mcp", time.monotonic() + 60
        while time.monotonic() < deadline:  # wait for it to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        env = MCPToolEnv(server={"url": url}, check=CHECK, format="react")
        assert env.runner(ToolCall("calculator", {"expression": "123 * 456"})) == ("56088", True)
        text, ok = env.runner(ToolCall("calculator", {"expression": "1 / 0"}))
        assert not ok and text == "Error: calculator raised CalculatorError: division by zero"
    finally:
        close_servers()
        server.terminate()
        server.wait(10)


def test_bad_servers_and_options_are_errors_naming_them():
    with pytest.raises(ValueError, match="exactly one of 'command'"):
        check_server_spec({"command": "x", "url": "http://y"})
    with pytest.raises(ValueError, match="unknown key 'comand'"):
        check_server_spec({"comand": "x"})
    with pytest.raises(ValueError, match="'search' is not served by .* serves calculator, crash, die, hang, pid"):
        MCPToolEnv(server=SERVER, check=CHECK, allowed_tools=["search"])
    with pytest.raises(ValueError, match="isolation"):
        MCPToolEnv(server=SERVER, check=CHECK, isolation="process")
    started = time.monotonic()
    with pytest.raises(MCPServerError, match="could not be started"):
        MCPToolEnv(server={"command": "python", "args": ["-c", "import sys; sys.exit(3)"]}, check=CHECK)
    with pytest.raises(MCPServerError, match="startup_timeout"):
        MCPToolEnv(server={"command": "python", "args": ["-c", "import time; time.sleep(60)"], "startup_timeout": 1},
                   check=CHECK)
    assert time.monotonic() - started < 20
    assert server_processes("time.sleep(60)") == []  # the server that never answered was stopped


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_tool_given_by_its_schema_and_a_failure_worded_for_the_model(isolation):
    """What MCPToolEnv builds on, without a server: Tool(schema, fn) and ToolFailure."""
    from agentrl.envs.tools import Tool, ToolFailure, ToolRunner

    schema = {"type": "function", "function": {"name": "echo", "description": "Echo the text.", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    def anything(**arguments):
        if arguments["text"] == "bad":
            raise ToolFailure("echo refuses 'bad'")
        return arguments["text"]

    runner = ToolRunner([Tool(schema, anything)], isolation=isolation)
    assert runner.schemas == {"echo": schema}
    assert runner(ToolCall("echo", {"text": "hi"})) == ("hi", True)
    assert runner(ToolCall("echo", {"text": "bad"})) == ("Error: echo refuses 'bad'", False)
    assert runner(ToolCall("echo", {"text": 1})) == ("Error: echo: argument 'text' must be string, got int", False)


def test_a_dead_server_marks_the_episode_an_infra_failure_a_tool_error_does_not():
    """The server dying is not the policy's doing: the episode's info says infra_failure (the trainers leave it
    out of the loss); a tool's own error (a bad expression) is the policy's and leaves no such mark."""
    env = MCPToolEnv(server=SERVER, check=CHECK, format="react", timeout=2.0)
    env.reset({"question": "What is 2 + 2?", "answer": "4"})
    env.step("Thought: x\nAction: calculator(2 +)\n")
    assert "infra_failure" not in env.step("Answer: 4").info
    env.reset({"question": "What is 2 + 2?", "answer": "4"})
    result = env.step("Thought: x\nAction: die({})\n")
    assert "closed the connection" in result.observation and result.info.get("infra_failure") is True
    assert env.step("Answer: 4").info.get("infra_failure") is True
    env.reset({"question": "What is 2 + 2?", "answer": "4"})  # a new episode starts unmarked
    assert "infra_failure" not in env.step("Answer: 4").info
