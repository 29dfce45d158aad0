"""Environments from other projects' ecosystems, each behind an optional dependency (`pip install
agentrl[ecosystems]`): reasoning-gym's task families (reasoning_gym.py), MCP servers' tools (mcp_tools.py) and
textarena's games (textarena_games.py). Import the module you use; nothing here imports those packages."""
