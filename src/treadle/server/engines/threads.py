"""Workers on threads of the API process (`--engine-processes false`): the same Worker code
a worker process runs, over an in-process socket (inproc://), so the in-process app the
tests use runs the production worker, protocol, recovery and fault handling.

One thread per served model (and replica) runs its Worker until it is drained; a worker that
an engine fault ended is told to the hub as a worker process's exit is, and a new one (a
fresh engine from the factory) takes its place after a short backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from treadle.protocol.worker_config import WorkerConfig
from treadle.server.config import ServerConfig
from treadle.server.engines.supervisor import MAX_BACKOFF_S, worker_config
from treadle.worker.process import Worker, load_engine

log = logging.getLogger("treadle.supervisor")

EngineFactory = Callable[[str, str, ServerConfig], Any]  # (name, folder, config) → Engine


def default_engine_factory(name: str, path: str, config: ServerConfig) -> Any:
    """The Engine of a served model (what a worker thread runs)."""
    return load_engine(worker_config(config, name, path))


class ThreadWorkers:
    def __init__(
        self,
        config: ServerConfig,
        address: str,
        token: str,
        on_exit: Callable[[str, int, str, list[str]], None],
        make_engine: EngineFactory,
    ):
        self.config, self.address, self.token = config, address, token
        self.on_exit = on_exit
        self.make_engine = make_engine
        self.workers: dict[tuple[str, int], Worker] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, path in self.config.models.items():
            for replica in range(self.config.replicas):
                wconfig = worker_config(self.config, name, path)
                thread = threading.Thread(
                    target=self._run,
                    args=(wconfig, replica),
                    name=f"worker-{name}-{replica}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain every worker (what was acknowledged runs, the state is written)."""
        self._stopping.set()
        timeout_s = timeout_s if timeout_s is not None else self.config.drain_timeout_s + 10
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.drain_and_exit()
        for worker in workers:
            worker.wait(timeout_s)

    def _run(self, wconfig: WorkerConfig, replica: int) -> None:
        backoff = 0.5
        while not self._stopping.is_set():
            engine = self.make_engine(wconfig.name, wconfig.path, self.config)
            worker = Worker(wconfig, self.address, self.token, replica, engine, in_thread=True)
            with self._lock:
                if self._stopping.is_set():
                    return
                self.workers[(wconfig.name, replica)] = worker
            worker.run()
            if self._stopping.is_set() or worker.fault is None:
                return
            reason = f"its engine faulted ({worker.fault})"
            log.error("%s (replica %d): %s; starting a new one", wconfig.name, replica, reason)
            self.on_exit(wconfig.name, replica, reason, [])  # the fault named its ops
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
