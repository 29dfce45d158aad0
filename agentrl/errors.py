"""The one exception type for a user's mistake (a config key, a data row, a file, an environment spec).

Its message starts with where the mistake is (`file:line` or the config key), so the command line prints
it as one line, `agentrl: error: <where>: <what>`, instead of a traceback.
"""


class UserError(ValueError):
    """A mistake in what the user gave agentrl; the message names the file and line, or the key."""
