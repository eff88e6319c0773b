"""SSE framing: every event is one `data:` line whichever way a client splits lines."""
from __future__ import annotations

import json

import pytest

from resin.server.serving_common import sse

pytestmark = pytest.mark.unit


def test_an_event_is_one_line_even_for_unicode_line_separators():
    text = "a\u2028b\u2029c\x85d\x1ce\nf\r g \u00e9\u65e5"
    event = sse({"choices": [{"text": text}]})
    lines = event.splitlines()  # the strictest splitter: every Unicode line boundary
    assert lines == [event[:-2]] + [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    assert "\u00e9\u65e5" in event  # other text stays UTF-8, not \\u escapes
