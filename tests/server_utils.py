"""A real `resin run` subprocess on 127.0.0.1 and a free port, for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, launcher: list[str] | None = None,
                 port: int | None = None):
        """launcher: what runs the CLI (default `python -m resin.cli`); a test may wrap it to inject a fault.
        port: default a free one."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="resin-server-", suffix=".log", delete=False)
        cmd = [*(launcher or [sys.executable, "-m", "resin.cli"]), "run", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout: float = 180) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def client(self, **kw):
        from openai import OpenAI

        kw.setdefault("api_key", self.api_key or "unused")
        return OpenAI(base_url=self.url + "/v1", max_retries=0, **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        kw.setdefault("api_key", self.api_key or "unused")
        return AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name (+ labels other than model_name), parsed with prometheus-client."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.unlink(self.log.name)
