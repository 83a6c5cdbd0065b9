"""The one exception type users see.

Anything raised as a :class:`BlockloopError` is a problem with the user's input or environment (unknown
preset, missing file, impossible shape), so the CLI prints its message on one line and exits non-zero
instead of showing a traceback. Everything else is a bug and keeps its traceback.
"""


class BlockloopError(Exception):
    """A user-facing error whose message names the problem and the fix."""


class ConfigError(BlockloopError, ValueError):
    """A configuration that cannot describe a working model or run."""
