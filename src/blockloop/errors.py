"""The exceptions users see: :class:`BlockloopError` and its kinds (a config, a context length).

Anything raised as a :class:`BlockloopError` is a problem with the user's input or environment (unknown
preset, missing file, impossible shape), so the CLI prints its message on one line and exits non-zero
instead of showing a traceback. Everything else is a bug and keeps its traceback.
"""


class BlockloopError(Exception):
    """A user-facing error whose message names the problem and the fix."""


class ConfigError(BlockloopError, ValueError):
    """A configuration that cannot describe a working model or run."""


class ContextLengthError(BlockloopError, ValueError):
    """More tokens than a model's context (or an engine slot) holds."""


def check_context(length: int, context: int, what: str, fix: str = "shorten the input") -> None:
    """The one context-length check: ``what`` of ``length`` tokens must fit ``context``.

    Raised as a :class:`ContextLengthError` (a ``ValueError`` too, so model code keeps the exception type
    tensor code expects) with the message every caller used to write by hand.
    """
    if length > context:
        raise ContextLengthError(f"{what} of {length} tokens exceeds the model context of {context}; {fix}")


def utf8_problem(text: str) -> str | None:
    """What keeps ``text`` from being UTF-8, or None. Python carries undecodable input bytes (and JSON its
    ``\\ud800`` escapes) as lone surrogates, which no tokenizer can encode: callers refuse them up front."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:  # how Python carries a byte it could not decode (the "surrogateescape" rule)
            return f"is not valid UTF-8 text (byte 0x{code - 0xDC00:02X} at character {exc.start})"
        return f"is not valid UTF-8 text (a lone surrogate at character {exc.start})"
    return None
