"""Start `treadle serve` as a child process on a free port, for demos, tests and benchmarks.

with ServerProcess({"treadle/tiny-llama": ".models/tiny-llama"}, data_dir) as server:
    client = ServiceClient(base_url=server.url)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies, so a killed
    demo or test run never leaves a server behind. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerStartError(RuntimeError):
    """`treadle serve` exited before it served; `reason` is its last line (what it said)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        models: dict[str, str | Path],
        data_dir: str | Path,
        port: int = 0,
        config: dict | None = None,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
    ):
        self.models = models
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.config = config  # extra ServerConfig fields, passed as a --config file
        self.extra_args = extra_args or []
        self.log_path = Path(log_path) if log_path else self.data_dir / "server.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """The first served model's name."""
        return next(iter(self.models))

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "treadle.cli", "serve", "--port", str(self.port)]
        cmd += ["--data-dir", str(self.data_dir), *self.extra_args]
        if self.config:
            config_path = self.data_dir / f"config-{self.port}.json"
            config_path.write_text(json.dumps(self.config))
            cmd += ["--config", str(config_path)]
        for name, path in self.models.items():
            cmd += ["--model", f"{name}={path}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the handle
            # a process group of its own: a Ctrl-C meant for the caller (a demo, a test run)
            # does not reach it; the caller stops it (one SIGTERM: it drains), or its death
            # does (PDEATHSIG)
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
                process_group=0,
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                lines = log.strip().splitlines()
                raise ServerStartError(
                    f"treadle serve exited early:\n{log[-4000:]}", lines[-1] if lines else ""
                )
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"treadle serve not healthy after {self.startup_timeout_s}s:\n{self.log()[-4000:]}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def children(self) -> list[int]:
        """The server's child processes (its engine workers)."""
        found: list[int] = []
        if self.proc is None:
            return found
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL the server and its workers at once, as a machine crash would."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for pid in [self.proc.pid, *self.children()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the server drains what it acknowledged), then SIGKILL after timeout_s."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
