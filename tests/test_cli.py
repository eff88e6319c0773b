"""The `resin` command line, run as a real subprocess where behaviour at the process boundary matters."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from resin.cli import main
from resin.models import MODEL_REGISTRY, llama

pytestmark = pytest.mark.e2e

RESIN = [sys.executable, "-m", "resin.cli"]


def run(*args, timeout=300, **kw):
    return subprocess.run([*RESIN, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("sub", ["generate", "chat", "backends", "models", "parity"])
def test_help_on_every_subcommand(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0 and "usage: resin " + sub in capsys.readouterr().out


@pytest.mark.parametrize("backend,arch", [("rocm", None), ("cuda", None), ("rocm", "gfx950"), ("cuda", "sm_100")])
def test_backends_for_absent_gpus_print_a_table(backend, arch):
    proc = run("backends", "--backend", backend, *(["--arch", arch] if arch else []))
    assert proc.returncode == 0, proc.stderr
    assert "hypothetical" in proc.stdout and "attention" in proc.stdout and "why earlier providers" in proc.stdout
    if arch:
        assert arch in proc.stdout


def test_generate_on_absent_backend_fails_clearly():
    proc = run("generate", "hi", "--backend", "rocm")
    assert proc.returncode != 0
    assert "--backend rocm" in proc.stderr and "torch.version.hip" in proc.stderr and "Traceback" not in proc.stderr


def test_models_lists_architectures_and_ops():
    proc = run("models")
    assert proc.returncode == 0, proc.stderr
    for arch in MODEL_REGISTRY:
        assert arch in proc.stdout
    assert "attention" in proc.stdout and "silu_and_mul" in proc.stdout


def test_parity_passes_on_each_architecture(capsys):
    for arch in MODEL_REGISTRY:
        assert main(["-q", "parity", arch, "--steps", "8"]) == 0
        out = capsys.readouterr().out
        assert "RESULT: PASS" in out and "prefill  max |logit diff|" in out


class WrongRopeLlama(llama.LlamaForCausalLM):
    """Test-only broken port: the rotary base is read wrong."""

    @classmethod
    def parse_config(cls, c):
        cfg = super().parse_config(c)
        cfg.rope_theta *= 3
        return cfg


def test_parity_fails_on_a_broken_port(monkeypatch, capsys):
    monkeypatch.setitem(MODEL_REGISTRY, "LlamaForCausalLM", WrongRopeLlama)
    assert main(["-q", "parity", "LlamaForCausalLM", "--steps", "8"]) == 1
    out = capsys.readouterr().out
    assert "RESULT: FAIL" in out and "FAIL" in out.split("prefill")[1].splitlines()[0]


def test_parity_subprocess_exit_code():
    proc = run("-q", "parity", "Qwen2ForCausalLM", "--steps", "4")
    assert proc.returncode == 0 and "RESULT: PASS" in proc.stdout, proc.stdout + proc.stderr


def test_generate_streams_incrementally():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([*RESIN, "-q", "generate", "--chat", "Write a long story about a dragon.",
                             "--max-tokens", "96", "--ignore-eos", "--kv-cache-memory", "128MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    chunks = []
    while True:
        data = os.read(proc.stdout.fileno(), 4096)
        if not data:
            break
        chunks.append((time.monotonic(), data))
    end = time.monotonic()
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    text = b"".join(c for _, c in chunks).decode()
    assert len(text.split()) > 20
    assert len(chunks) >= 5  # pieces arrived separately...
    assert end - chunks[0][0] > 0.3  # ...and the first came well before generation ended


def test_chat_keeps_the_conversation():
    proc = run("-q", "chat", "--kv-cache-memory", "128MiB", "--max-tokens", "40",
               input="What is the capital of France? Answer in one word.\nAnd what language do they speak there?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert "Paris" in lines[0]
    assert "French" in proc.stdout
