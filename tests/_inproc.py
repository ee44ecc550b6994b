"""A real `treadle serve` inside the test process: uvicorn on a thread and a free port, the
real app, and its engine worker on a thread (`engine_processes` false: the same Worker code
over an in-process socket). Clients (both SDKs, httpx, the openai client) talk to it over
loopback as to a server process, and a feature test pays no process start (an interpreter,
torch and the model, twice: the API and its worker).

Tests of what only processes do (a kill, a restart of a worker process, torchrun groups,
OOM) keep `treadle.launch.ServerProcess`.

    with InProcessServer({"treadle/tiny-llama": model_dir}, data_dir) as server:
        ServiceClient(base_url=server.url)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from treadle.launch import free_port


class _Log(logging.Handler):
    """What the server logged, as `ServerProcess.log()` returns a process's output."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InProcessServer:
    def __init__(
        self,
        models: dict[str, str | Path],
        data_dir: str | Path,
        config: dict | None = None,
        startup_timeout_s: float = 120.0,
    ):
        self.models = {name: str(path) for name, path in models.items()}
        self.data_dir = Path(data_dir)
        self.config = config or {}
        self.port = free_port()
        self.startup_timeout_s = startup_timeout_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._log = _Log()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        return next(iter(self.models))

    def start(self) -> InProcessServer:
        from treadle.server.app import create_app
        from treadle.server.config import ServerConfig

        self.data_dir.mkdir(parents=True, exist_ok=True)
        # the settings as a config file, as ServerProcess passes them (the CLI reads it too)
        (self.data_dir / f"config-{self.port}.json").write_text(json.dumps(self.config))
        settings = {**self.config, "engine_processes": False}
        config = ServerConfig(
            models=self.models, data_dir=str(self.data_dir), port=self.port, **settings
        )
        logging.getLogger("treadle").addHandler(self._log)
        logging.getLogger("treadle").setLevel(logging.INFO)
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                timeout_keep_alive=75,
            )
        )
        self._thread = threading.Thread(target=self._server.run, name="inproc-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server stopped at start:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout_s} s")

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def log(self) -> str:
        return "\n".join(self._log.lines)

    def stop(self, timeout_s: float = 60.0) -> None:
        """As SIGTERM does: what was acknowledged drains, every model's state is written."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
        logging.getLogger("treadle").removeHandler(self._log)

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
