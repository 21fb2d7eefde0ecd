"""Stop strings matched on text, not tokens, without ever streaming part of a stop string.

A stop string can span token boundaries ("\\n\\nUser:" arriving as "\\n", "\\nUser", ":"), so matching runs on
the decoded text. Text is released only when no stop string could still start inside it: the longest tail of
the pending text that is a prefix of some stop string is held back until the next delta decides it.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""  # text received but not yet released

    def feed(self, delta: str) -> tuple[str, str | None]:
        """-> (text safe to release, the stop string matched or None). After a match the output ends there."""
        if not self.stops:
            return delta, None
        pending = self.held + delta
        match_at, matched = -1, None
        for s in self.stops:
            i = pending.find(s)
            if i >= 0 and (match_at < 0 or i < match_at):
                match_at, matched = i, s
        if matched is not None:
            self.held = ""
            return pending[:match_at], matched
        keep = self._partial_tail(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def flush(self) -> str:
        """At the end of generation (not by a stop string): the held text was never a stop, release it."""
        held, self.held = self.held, ""
        return held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
