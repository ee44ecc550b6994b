"""Shared fixtures: a tiny model folder, and real server processes on free ports.

`treadle_server` is one `treadle serve` process for the whole test session (tests create
their own sessions on it); `start_server` starts more, e.g. with a short heartbeat timeout
or to restart on the same data folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

TINY_MODEL_NAME = "treadle/tiny-llama"
API_KEY = "tml-treadle-tests"  # the tinker SDK insists on the tml- prefix


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from treadle.engine.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    data_dir: Path
    proc: subprocess.Popen
    log_path: Path
    model_name: str = TINY_MODEL_NAME
    extra: dict = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def launch_server(
    models: dict[str, Path], data_dir: Path, config: dict | None = None, timeout: float = 180
) -> ServerProcess:
    """`python -m treadle.cli serve ...`, or, when config overrides are given, uvicorn on the
    app factory with a ServerConfig file; returns once GET /api/v1/healthz answers."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if config:
        cfg = {
            "models": {k: str(v) for k, v in models.items()},
            "port": port,
            "data_dir": str(data_dir),
            **config,
        }
        cfg_path = data_dir / f"config-{port}.json"
        cfg_path.write_text(json.dumps(cfg))
        env["TREADLE_CONFIG"] = str(cfg_path)
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "treadle.server.app:app_from_env"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    else:
        cmd = [sys.executable, "-m", "treadle.cli", "serve", "--port", str(port)]
        cmd += ["--data-dir", str(data_dir)]
        for name, path in models.items():
            cmd += ["--model", f"{name}={path}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", data_dir, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/api/v1/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()}")


@pytest.fixture(scope="session")
def treadle_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = launch_server({TINY_MODEL_NAME: tiny_model_dir}, tmp_path_factory.mktemp("data"))
    yield server
    server.stop()


@pytest.fixture
def start_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator:
    """Factory: start_server(config=None, data_dir=None) → a fresh ServerProcess."""
    started: list[ServerProcess] = []

    def start(config: dict | None = None, data_dir: Path | None = None) -> ServerProcess:
        server = launch_server(
            {TINY_MODEL_NAME: tiny_model_dir}, data_dir or tmp_path / "data", config
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
