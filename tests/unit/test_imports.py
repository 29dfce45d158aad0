"""The layout's one rule: imports flow down the tree, so agentrl's import graph has no circle.

Module-level and function-level imports both count (a function-level import only hides a circle until
the function runs). Built from the source with `ast`, nothing is imported.
"""

import ast
from pathlib import Path

import agentrl

ROOT = Path(agentrl.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """agentrl module -> the agentrl modules it imports anywhere in its source."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub when there is one
                targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "black"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_agentrl_has_no_import_cycle():
    graph = import_graph()
    assert "agentrl.jobs.ppo" in graph and "agentrl.trainers.ppo" in graph["agentrl.jobs.ppo"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nothing_below_the_jobs_imports_a_job():
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.startswith(("agentrl.jobs", "agentrl.cli"))
                    for t in targets if t.startswith("agentrl.jobs"))
    assert not upward, upward
