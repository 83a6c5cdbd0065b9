"""From tokens to the text a client sees: incremental decoding and stop strings.

A token's text is not always the text of the token alone (a UTF-8 character split over byte tokens, a
tokenizer whose decoding depends on the neighbours), so each token's delta is the difference of two short
decodes over a sliding window, and a delta is only released once it ends in whole characters (the
incremental detokenizer of text-generation-inference and vLLM). The window starts on the prompt's last
tokens, so the first delta carries what joins it to the prompt (a word tokenizer's space, a SentencePiece
token's leading space that a lone decode drops). Text that could be the start of a stop string is held back
until it is known not to be one, so a stop string never reaches the client.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from blockloop.data.tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
CONTEXT = 6  # prompt tokens the first decode window starts on (vLLM keeps 5)


class TextStream:
    """The text deltas of one request's tokens after ``prompt``; ``stopped`` once a stop string or a stop token
    ends it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), stop_ids: Collection[int] = (), *,
                 prompt: Sequence[int] = ()) -> None:
        self.tokenizer, self.stop, self.stop_ids = tokenizer, [s for s in stop if s], frozenset(stop_ids)
        self.ids: list[int] = list(prompt)[-CONTEXT:]
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read] decoded last time; ids[read:] not released yet
        self.text = ""  # all text decoded to whole characters
        self.sent = 0  # characters of ``text`` released
        self.stopped = False

    def push(self, token: int) -> str:
        """The text to release after ``token`` (often empty: an unfinished character, a possible stop string)."""
        if token in self.stop_ids:
            self.stopped = True
            return self._release(len(self.text))
        self.ids.append(token)
        self._decode(final=False)
        return self._after_stops()

    def flush(self) -> str:
        """Everything held back, once the request has ended without a stop (incomplete characters decode to U+FFFD,
        which a stop string may hold: then the request ends there, ``stopped``)."""
        if self.stopped:
            return ""
        self._decode(final=True)
        end = self._first_stop()
        if end is not None:
            self.stopped, self.text = True, self.text[:end]
        return self._release(len(self.text))

    def _decode(self, final: bool) -> None:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT)):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def _first_stop(self) -> int | None:
        """Where the first stop string in the unreleased text starts, if one is there."""
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _after_stops(self) -> str:
        end = self._first_stop()
        if end is not None:
            self.stopped, self.text = True, self.text[:end]
            return self._release(end)
        held = max((k for s in self.stop for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - held)

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


def continuation(tokenizer: Tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``prompt`` (what a stream of them releases in all)."""
    stream = TextStream(tokenizer, prompt=prompt)
    return "".join(stream.push(token) for token in ids) + stream.flush()
