"""Stop strings over streamed text: release what is safe, hold what may become a stop string.

One matcher per sequence, fed with the detokenizer's deltas. `feed(delta)` returns the text that can
go to the client now and, once a stop string has appeared, that stop string:

- a stop string may span several deltas ("<|", "end", "|>"), so the matcher keeps the text it has
  not released and searches it together with the new delta;
- text that could still be the start of a stop string is held back: exactly the longest suffix
  that is a proper prefix of some stop string (for stops ("###",) and text "a ##" it holds "##"
  and releases "a "), never a fixed window, so ordinary text goes out without delay;
- on a match it releases the text before the stop (plus the stop itself with include_stop) and
  drops everything after it; the sequence is over, and feeding more is an error.

Which stop wins when several occur: the one that is complete first in the text (smallest end
position; on a tie, the longer one, which starts earlier). That is the stop at which token-by-token
generation would have ended, and it does not depend on how the text was split into deltas.

`flush()` at the end of generation (max_tokens, EOS, a stop token id) releases the held text.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stops))  # unique, in the caller's order
        self._include_stop = include_stop
        self._held = ""  # unreleased text: a proper prefix of some stop string, never a whole one
        self._matched: str | None = None
        self._done = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    @property
    def held(self) -> str:
        """The text fed but not yet released."""
        return self._held

    def feed(self, text: str) -> tuple[str, str | None]:
        """(releasable text, matched stop string or None) after appending `text`."""
        if self._done:
            raise RuntimeError("StopStringMatcher: feed after a stop string matched or after flush")
        if not self._stops:
            return text, None
        buffer = self._held + text
        match = self._first_match(buffer, len(self._held))
        if match is not None:
            start, stop = match
            self._held, self._matched, self._done = "", stop, True
            return buffer[:start] + (stop if self._include_stop else ""), stop
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release the held text at the end of generation; the matcher takes no more text after it."""
        held, self._held, self._done = self._held, "", True
        return held

    def _first_match(self, buffer: str, held: int) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that ends first; None if no stop occurs.

        The held part contains no whole stop, so an occurrence must end in the new text: the
        search for each stop starts where such an occurrence could begin.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = buffer.find(stop, max(0, held - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_length, stop = best
        return end + neg_length, stop

    def _partial_stop_length(self, buffer: str) -> int:
        return partial_prefix_length(buffer, self._stops)


def partial_prefix_length(buffer: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of buffer that is a proper prefix of some string of `stops`
    (what streamed text must hold back while it may still become one of them)."""
    if not buffer:
        return 0
    last = buffer[-1]
    longest = 0
    for stop in stops:
        # candidate lengths k end on a position of `last` in stop[:len(stop) - 1]; try them longest first
        j = stop.rfind(last, 0, min(len(stop) - 1, len(buffer)))
        while j + 1 > longest:
            if buffer.endswith(stop[: j + 1]):
                longest = j + 1
                break
            j = stop.rfind(last, 0, j)
    return longest
