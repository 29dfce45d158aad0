"""agentrl's calculator served by a real MCP server over stdio (or streamable HTTP), for configs/chat-mcp.yaml:

    python -m agentrl.envs.ecosystems.mcp_calculator_server                  # stdio, as agentrl starts it
    python -m agentrl.envs.ecosystems.mcp_calculator_server --http 8000      # http://127.0.0.1:8000/mcp
    python -m agentrl.envs.ecosystems.mcp_calculator_server --test-tools     # plus tools that misbehave

The tool has the in-process tool's name, description and parameter schema (taken from the same function),
and a failure reads as the in-process runner words it ("calculator raised CalculatorError: ..."), so an
episode through this server has the same token ids as one with agentrl.envs.calculator.calculator.
`--test-tools` adds `hang` (never returns), `crash` (raises an unexpected exception) and `die` (ends the
server process), for the failure tests of mcp_tools.
"""

from __future__ import annotations

import argparse
import os
import time


def build_server(test_tools: bool = False):
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.server.mcpserver.tools import Tool

    from agentrl.envs.calculator import calculator
    from agentrl.envs.tools import tool_schema

    def serve_calculator(expression: str) -> str:
        try:
            return calculator(expression)
        except Exception as e:  # noqa: BLE001 - the model reads any failure, in the in-process runner's words
            raise ToolError(f"calculator raised {type(e).__name__}: {e}") from e

    # The listed schema is transformers' schema of the in-process function, not the one pydantic derives from
    # serve_calculator (which adds "title" keys): same tool, same prompt tokens.
    schema = tool_schema(calculator)["function"]
    tool = Tool.from_function(serve_calculator, name=schema["name"], description=schema["description"],
                              structured_output=False)
    tools = [tool.model_copy(update={"parameters": schema["parameters"]})]
    server = MCPServer("agentrl-calculator", tools=tools, log_level="WARNING")
    if test_tools:
        @server.tool()
        def hang(seconds: float = 3600.0) -> str:
            """Sleep for `seconds` (a tool that hangs)."""
            time.sleep(seconds)
            return "woke up"

        @server.tool()
        def crash(message: str = "boom") -> str:
            """Raise an unexpected exception (its text stays on the server)."""
            raise RuntimeError(message)

        @server.tool()
        def die(status: int = 3) -> str:
            """End the server process without answering."""
            os._exit(status)

        @server.tool()
        def pid() -> str:
            """The server's process id."""
            return str(os.getpid())
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    parser.add_argument("--test-tools", action="store_true", help="add the hang, crash, die and pid tools")
    args = parser.parse_args(argv)
    server = build_server(args.test_tools)
    if args.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
