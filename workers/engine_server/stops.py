"""Stop sequences, as vLLM applies them: a generation ends at the first of its `stop` strings or
`stop_token_ids`, and neither the string nor the token is returned (finish_reason "stop", and
vLLM's `stop_reason` names which). While streaming, text that could be the start of a stop
string is held back until it is known not to be one.

The engine itself stops at its end-of-text token or max_tokens; the server cuts the text."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopScanner:
    def __init__(self, stops: Sequence[str], stop_ids: Sequence[int], decode: Callable[[list[int]], str]):
        self.stops = [s for s in stops if s]
        self.stop_ids = set(stop_ids)
        self.decode = decode
        self.ids: list[int] = []  # tokens before the stop (all of them while none was hit)
        self.emitted = 0  # characters of the text already handed out
        self.reason: str | int | None = None  # the stop string or token id that ended the generation
        self.cut: int | None = None  # where the text ends, when a stop string ended it

    def feed(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        """Text that is safe to hand out now, and whether a stop was reached."""
        for i, token in enumerate(new_ids):
            if token in self.stop_ids:
                self.ids.extend(new_ids[:i])
                self.reason = token
                return self._rest(), True
        self.ids.extend(new_ids)
        text = self.decode(self.ids)
        hits = [(text.find(stop, self.emitted), stop) for stop in self.stops]
        hits = [(position, stop) for position, stop in hits if position >= 0]
        if hits:
            position, self.reason = min(hits)
            self.cut = position
            out, self.emitted = text[self.emitted : position], position
            return out, True
        held = max((k for stop in self.stops for k in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:k])), default=0)  # a suffix that may grow into a stop string
        safe = max(self.emitted, len(text) - held)
        out, self.emitted = text[self.emitted : safe], safe
        return out, False

    def _rest(self) -> str:
        text = self.decode(self.ids)
        out, self.emitted = text[self.emitted :], len(text)
        return out

    def finish(self) -> str:
        """What was held back, once the generation ended without a stop."""
        return self._rest()

    def text(self) -> str:
        """The whole text up to the stop (the non-streaming answer)."""
        full = self.decode(self.ids)
        return full[: self.cut] if self.cut is not None else full
