"""A `hardy serve` subprocess for the serving tests, and the plain HTTP client they talk to it with."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys

from conftest import REPO


FAULT_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_hooks")


def fault_env(spec: str) -> dict:
    """The environment that makes a served model's passes fail ("prefill@N,decode@M"): the test hook in
    tests/fault_hooks, loaded at start-up by every process of the server (torchrun's workers too)."""
    path = os.pathsep.join(filter(None, [FAULT_HOOKS, os.environ.get("PYTHONPATH")]))
    return {"HARDY_TEST_SERVE_FAULT": spec, "PYTHONPATH": path}


class Served:
    def __init__(self, model: str, *extra: str, env: dict | None = None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "hardy", "serve", "--model", model, "--port", "0", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
        line = self.proc.stdout.readline()
        assert "serving" in line, line + self.proc.stderr.read()
        self.banner = line
        self.port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        self.stderr = ""  # what the server said on stderr, once stopped

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        return resp.status, resp.headers, payload  # headers: case-insensitive

    def json(self, method, path, body=None, **kw):
        status, headers, payload = self.request(method, path, body, **kw)
        return status, headers, json.loads(payload)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
