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
