"""Incremental detokenising: text grows token by token, correct across multi-byte UTF-8 and stop strings.

Each step decodes a short window of recent ids twice (with and without the newest tokens) and emits the
difference, so a character split over several byte-level tokens appears only once it is whole, and tokenizers
that drop a word's leading space when decoding it alone still get it right.
"""
from __future__ import annotations

from typing import Any

# Decoding starts this many tokens before the prompt's end, so the first output token gets its leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text = ""
        self._held = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string it completed (the text is then cut before it), else None.
        With check_stop False (before min_tokens) stop strings are not looked for."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character or a token that decodes to nothing yet
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta)) if check_stop else None

    def _check_stop(self, delta_len: int) -> str | None:
        """Cut the text before the earliest stop string that the new text completed."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            start = max(0, len(self.text) - delta_len - len(s) + 1)  # a match must touch the new text
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def stable_text(self, finished: bool) -> str:
        """Text safe to stream: while running, hold back a tail that could still grow into a stop string."""
        if finished or not self._held:
            return self.text
        return self.text[:max(len(self.text) - self._held, 0)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
