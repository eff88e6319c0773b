"""Incremental detokenising across multi-byte UTF-8, and stop strings that span tokens."""
from __future__ import annotations

import pytest

from conftest import CORPUS
from resin.core.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", CORPUS)
def test_incremental_text_equals_full_decode(bpe_tokenizer, text):
    prompt = bpe_tokenizer.encode("Hello")
    ids = bpe_tokenizer.encode(text)
    detok = IncrementalDetokenizer(bpe_tokenizer, prompt)
    full = bpe_tokenizer.decode(ids)
    multi_byte_pending = 0
    for t in ids:
        before = detok.text
        detok.add(t)
        assert "\ufffd" not in detok.text and full.startswith(detok.text)
        multi_byte_pending += detok.text == before
    assert detok.text == full
    if any(ord(c) > 0x7FF for c in text):
        assert multi_byte_pending > 0  # some tokens carried only part of a character


@pytest.mark.parametrize("stop", ["STOP", "n fox j", "lazy dog. ST", "🚀"])
def test_stop_string_spanning_tokens_is_cut(bpe_tokenizer, stop):
    text = CORPUS[3] if stop != "🚀" else CORPUS[2]
    ids = bpe_tokenizer.encode(text)
    detok = IncrementalDetokenizer(bpe_tokenizer, [], stop=[stop, "never-there"])
    hit = None
    for i, t in enumerate(ids):
        hit = detok.add(t)
        if hit:
            break
    assert hit == stop
    assert detok.text == text[:text.index(stop)]
    assert stop not in detok.text


def test_earliest_stop_wins_and_stable_text_holds_back(bpe_tokenizer):
    text = CORPUS[3]
    detok = IncrementalDetokenizer(bpe_tokenizer, [], stop=["END", "quick"])
    held = []
    for t in bpe_tokenizer.encode(text):
        if detok.add(t):
            break
        held.append(detok.stable_text(finished=False))
        assert len(held[-1]) >= len(detok.text) - 4 and detok.text.startswith(held[-1])
    assert detok.text == "The "
    assert detok.stable_text(finished=True) == "The "


class _CountingTokenizer:
    """Counts how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("repeat", ["special", "invalid_bytes"])
def test_tokens_that_decode_to_nothing_do_not_grow_the_window(bpe_tokenizer, repeat):
    """A model repeating a skipped special token (or invalid UTF-8 bytes) must cost O(1) per token, not O(n)."""
    if repeat == "special":
        token = bpe_tokenizer.convert_tokens_to_ids("<|end|>")
    else:
        token = bpe_tokenizer.convert_tokens_to_ids("\u00ff")  # byte 0xff: never valid UTF-8
    costs = []
    for n in (200, 800):
        counting = _CountingTokenizer(bpe_tokenizer)
        detok = IncrementalDetokenizer(counting, bpe_tokenizer.encode("Hello"))
        for _ in range(n):
            detok.add(token)
        costs.append(counting.decoded / n)
        for t in bpe_tokenizer.encode(" world"):
            detok.add(t)
        assert detok.text.endswith(" world")
    assert costs[1] < 1.5 * costs[0] and costs[1] < 60, costs


def test_an_invalid_byte_before_a_split_character_still_decodes_like_the_whole(bpe_tokenizer):
    bad = bpe_tokenizer.convert_tokens_to_ids("\u00ff")  # byte 0xff: never valid UTF-8
    ids = [bad] + bpe_tokenizer.encode("ϏÜ日本") + [bad, bad] + bpe_tokenizer.encode("🙂 ok")
    detok = IncrementalDetokenizer(bpe_tokenizer, [])
    for t in ids:
        detok.add(t)
    detok.finish()
    assert detok.text == bpe_tokenizer.decode(ids)
