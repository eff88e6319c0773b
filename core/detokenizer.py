"""Incremental detokenising: text grows token by token, correct across multi-byte UTF-8 and stop strings.

Each step decodes a short window of recent ids twice (with and without the newest tokens) and emits the
difference, so a character split over several byte-level tokens appears only once it is whole, and tokenizers
that drop a word's leading space when decoding it alone still get it right.

Text is kept as settled pieces plus a short pending tail (the characters a stop string could still claim), so a
step costs O(new text), never O(text so far): a long generation is O(length) on the engine thread, and the
engine can hand out just the new text (`take_delta`) instead of the whole string each step.
"""
from __future__ import annotations

from typing import Any

# Decoding starts this many tokens before the prompt's end, so the first output token gets its leading space.
_CONTEXT_TOKENS = 5
# A trailing U+FFFD is waited on as the start of a character whose other bytes come with the next tokens; one still
# there after this many tokens (a character has at most 4 bytes) is invalid bytes and goes out as it is, else
# every later step would decode a longer window.
_MAX_WAIT_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        # Longest tail that could still become the start of a stop string: held back from streaming.
        self._held = max((len(s) for s in self.stop), default=1) - 1
        self._settled: list[str] = []  # text no stop string can cut any more
        self._pending = ""  # at most _held characters (plus one step's new text while it is checked)
        self._taken = 0  # settled pieces already handed out by take_delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string it completed (the text is then cut before it), else None.
        With check_stop False (before min_tokens) stop strings are not looked for."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full == prefix:  # decodes to nothing (a skipped special token): move on, or the window would grow
            self.read_offset = len(self.ids)
            self.prefix_offset = max(self.prefix_offset, self.read_offset - _CONTEXT_TOKENS)
            return None
        incomplete = full.endswith("\ufffd") and len(self.ids) - self.read_offset < _MAX_WAIT_TOKENS
        if len(full) < len(prefix) or incomplete:
            return None  # an incomplete character: wait for its other bytes
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._pending += delta
        hit = self._cut_at_stop(len(delta)) if check_stop else None
        settle = len(self._pending) - self._held
        if settle > 0:
            self._settled.append(self._pending[:settle])
            self._pending = self._pending[settle:]
        return hit

    def _cut_at_stop(self, delta_len: int) -> str | None:
        """Cut the text before the earliest stop string that the new text completed. A match touches the new
        text, so it starts at most _held characters before it: inside the pending tail, never in settled text."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            start = max(0, len(self._pending) - delta_len - len(s) + 1)
            idx = self._pending.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self._pending = self._pending[:best[0]]
        return best[1]

    def finish(self) -> None:
        """The sequence ended: the held tail can no longer become a stop string, so it settles."""
        if self._pending:
            self._settled.append(self._pending)
            self._pending = ""

    def take_delta(self) -> str:
        """Settled text not handed out before (call finish() first at the end to include the tail)."""
        new = self._settled[self._taken:]
        self._taken = len(self._settled)
        return "".join(new)

    @property
    def text(self) -> str:
        """All text so far, held tail included (O(length): for final outputs and tests, not per step)."""
        return "".join(self._settled) + self._pending

    def stable_text(self, finished: bool) -> str:
        """Text safe to stream: while running, without the tail that could still grow into a stop string."""
        return self.text if finished else "".join(self._settled)
