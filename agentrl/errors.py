"""The one exception type for a user's mistake (a config key, a data row, a file, an environment spec).

Its message starts with where the mistake is (`file:line` or the config key), so the command line prints
it as one line, `agentrl: error: <where>: <what>`, instead of a traceback.
"""


class UserError(ValueError):
    """A mistake in what the user gave agentrl; the message names the file and line, or the key."""


class EnvironmentContractError(UserError, TypeError):
    """A user's environment broke the protocol of agentrl.envs.base: its constructor, `reset` or `step` raised,
    or returned the wrong type. The message names the class, the method and what it returned.
    (A TypeError too, so callers that report a bad env.name/env.kwargs catch it with the missing attributes.)"""


class SignalExit(SystemExit):
    """The SystemExit a SIGTERM/SIGINT handler raises to stop the run: unlike a user's `sys.exit()` inside an
    environment or tool, it is never turned into a failed call or an environment error."""
