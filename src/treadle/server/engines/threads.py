"""Workers on threads of the API process (`--engine-processes false`): the same Worker code
a worker process runs, over an in-process socket (inproc://), so the in-process app the
tests use runs the production worker, protocol, recovery and fault handling.

One thread per served model (and replica) runs its Worker until it is drained; a worker that
an engine fault ended is told to the hub as a worker process's exit is, and a new one (a
fresh engine from the factory) takes its place after a short backoff. An engine that does
not load is a worker process's load failure (treadle.server.engines.restarts decides).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from treadle.protocol.load_failure import expected, reason_of
from treadle.protocol.worker_config import WorkerConfig
from treadle.server.config import ServerConfig
from treadle.server.engines.restarts import Restarts, given_up
from treadle.server.engines.supervisor import worker_config

if TYPE_CHECKING:
    from treadle.worker.process import Worker

log = logging.getLogger("treadle.supervisor")

EngineFactory = Callable[[str, str, ServerConfig], Any]  # (name, folder, config) → Engine


def default_engine_factory(name: str, path: str, config: ServerConfig) -> Any:
    """The Engine of a served model (what a worker thread runs)."""
    from treadle.worker.process import load_engine  # torch: only where engines run here

    return load_engine(worker_config(config, name, path))


class ThreadWorkers:
    def __init__(
        self,
        config: ServerConfig,
        address: str,
        token: str,
        on_exit: Callable[[str, int, str, list[str]], None],
        make_engine: EngineFactory,
        on_given_up: Callable[[str, int, str], None] = lambda *_: None,
    ):
        self.config, self.address, self.token = config, address, token
        self.on_exit = on_exit
        self.on_given_up = on_given_up
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
        name, restarts = wconfig.name, Restarts(self.config.worker_start_tries)
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                engine = self.make_engine(name, wconfig.path, self.config)
            except Exception as e:  # noqa: BLE001 - any failure to load is reported, once
                if not expected(e):
                    log.exception("loading %s", name)
                reason = reason_of(e, name, wconfig.path)
                served, load_failed = False, True
            else:
                from treadle.worker.process import Worker

                worker = Worker(wconfig, self.address, self.token, replica, engine, in_thread=True)
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self.workers[(name, replica)] = worker
                worker.run()
                if self._stopping.is_set() or worker.fault is None:
                    return
                reason = f"its engine faulted ({worker.fault})"
                served, load_failed = True, False
            self.on_exit(name, replica, reason, [])  # a fault named its ops
            wait_s = restarts.after_exit(served, load_failed, time.monotonic() - started)
            if wait_s is None:
                reason = given_up(reason, restarts.failures)
                log.error("%s (replica %d): %s; not starting it again", name, replica, reason)
                self.on_given_up(name, replica, reason)
                return
            log.error("%s (replica %d): %s; starting a new one", name, replica, reason)
            self._stopping.wait(wait_s)
