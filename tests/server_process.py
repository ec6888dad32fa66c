"""Starts `nanoserve serve` as a subprocess on a free port for end-to-end tests and stops it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/nanoserve-test-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metric(self, name: str, default: float | None = None) -> float:
        """A metric's value; `default` for one not exported yet (a labelled counter never incremented)."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> float:
        """The metric once it equals `value`, or its last reading after `timeout` s: engine gauges
        arrive with the engine's next stats, a little after the API server has answered."""
        deadline = time.monotonic() + timeout
        while (current := self.metric(name, 0.0)) != value and time.monotonic() < deadline:
            time.sleep(0.1)
        return current

    def wait_until(self, name: str, ok, timeout: float = 10.0) -> float:
        """The metric once `ok(value)` holds, or its last reading after `timeout` s (engine gauges)."""
        deadline = time.monotonic() + timeout
        while not ok(current := self.metric(name, 0.0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return current

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
