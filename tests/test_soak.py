"""A CI-sized run of bench/soak.py: mixed, partly hostile clients against a real server with a KV budget small
enough to preempt; nothing lost, nothing leaked, every greedy or seeded request equal to itself run alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_soak(text_model, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--model", str(text_model[0]),
                           "--requests", "200", "--concurrency", "48", "--kv-cache-memory", "2MiB", "--stall-hold", "5",
                           "--server-arg=--dtype", "--server-arg=float32", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = {k: v for k, v in report.items() if k != "mismatches"}
    print(json.dumps(summary, indent=1))
    assert report["ok"] and proc.returncode == 0, (summary, report["mismatches"], proc.stderr[-3000:])
    assert report["outcomes_add_up"] and report["server_5xx"] == 0 and report["server_outcomes"]["failed"] == 0
    assert report["different"] == 0 and report["compared_alone"] > 100
    assert report["kv_usage_after"] == 0 and report["running_after"] == 0 and report["waiting_after"] == 0
    # the hostile parts really happened: clients left, stalled readers were aborted, the cache preempted
    assert report["behaviours"]["disconnect"] > 0 and report["behaviours"]["stall"] > 0
    assert report["server_outcomes"]["aborted"] >= report["behaviours"]["stall"]
    assert report["preemptions"] > 0
