"""Stop strings: the one length limit both servers take them under, and a matcher over text
that grows piece by piece whose work is linear in the text.

``node.serving.serve`` (``node.serving.turn_options``) and the OpenAI server (``node.serving.openai_protocol``) refuse a
stop string longer than ``MAX_STOP_CHARS`` (a 400 naming the limit). The bound is what keeps a
streamed reply's matching cheap: ``StopScan`` holds back at most ``MAX_STOP_CHARS - 1``
characters (a tail that may begin a stop string) and, for each new piece, searches only the
held tail plus the piece -- never the whole reply again. Unbounded, a 1 MB stop string made one
reply's matching quadratic in its length (minutes of CPU for a single request).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_CHARS = 64
"""The longest stop string either server takes (characters)."""


def check_stop_lengths(stops: Sequence[str]) -> None:
    """ValueError unless every stop string has 1 to ``MAX_STOP_CHARS`` characters."""
    if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters")


class StopScan:
    """Stop strings found in text fed piece by piece (see the module docstring)."""

    def __init__(self, stops: Sequence[str] = ()):
        check_stop_lengths(stops)
        self.stops = tuple(stops)
        self.held = ""
        """Text fed but not released: a tail that may begin a stop string."""
        self.stopped = False
        """A stop string was met: the text ends before it; feed no more."""
        self.searched = 0
        """Characters searched so far, summed over stop strings: the work measure."""

    def feed(self, piece: str, final: bool = False) -> str:
        """The text now settled after ``piece``: up to the first stop string (then
        ``stopped``), else all but a tail that may begin one (all of it when ``final``)."""
        if self.stopped:
            return ""
        text = self.held + piece  # held < MAX_STOP_CHARS: a stop string met here lies in it
        self.searched += len(text) * len(self.stops)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[:min(cuts)]
        keep = 0 if final else self._stop_prefix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with (each check
        is at most ``MAX_STOP_CHARS`` long: a bounded cost per piece)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
