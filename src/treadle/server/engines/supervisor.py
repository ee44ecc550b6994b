"""Starts one `treadle worker` process per served model, watches it, restarts it.

Each worker is a child process that dies with the API (PDEATHSIG). A thread per worker
waits on the process: an exit (kill -9, a segfault, an error that took the interpreter
down) is known at once, told to the hub (so nothing waits for a heartbeat to lapse), and a
new worker is started, with a short backoff if workers keep dying.

With `devices` N > 1 the child is `torchrun --standalone --nproc-per-node N` running the
worker (treadle.worker.group): a group of N ranks for the model. A rank that dies takes
the group down (torchrun ends the others and exits), and the group is started again as
one worker would be. On GPUs each group gets GPUs of its own while there are enough
(treadle.server.engines.placement), through its CUDA_VISIBLE_DEVICES.

A worker that cannot load its model exits with EXIT_LOAD_FAILED and leaves its one-line
reason in a file (treadle.protocol.load_failure); when a worker is started again, and when
its model is given up instead, is treadle.server.engines.restarts's call. A model given up
is told to the hub (`on_given_up`), which fails its requests with the reason; at start-up
that stops the server.

A worker that crashed (killed by a signal of its own making: a segfault, an abort, a bus
error) leaves in its flight recorder (treadle.protocol.flight_recorder) the ops it was
running; they go with the exit to the hub, which blames them as it blames the ops of a
reported engine fault. A group's exit status is torchrun's, which does not say how its
rank died: the ranks' crash logs do. A SIGKILL is someone else's doing (an operator) and
blames nothing, unless the kernel's OOM killer sent it (our memory cgroup's oom_kill count
grew while the worker ran): a request that needs more memory than there is would otherwise
kill every new worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from treadle.protocol.flight_recorder import (
    FLIGHT_RECORDER_ENV,
    clear_crash_logs,
    read_crash,
    read_running,
)
from treadle.protocol.load_failure import EXIT_LOAD_FAILED, LOAD_FAILURE_ENV, read_reason
from treadle.protocol.worker_config import TOKEN_ENV, WorkerConfig
from treadle.sandbox.cgroup import own_oom_kills
from treadle.server.config import ServerConfig
from treadle.server.engines.placement import plan_gpus
from treadle.server.engines.restarts import Restarts, given_up

log = logging.getLogger("treadle.supervisor")

CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
)


def worker_config(config: ServerConfig, name: str, path: str) -> WorkerConfig:
    """The settings a worker of model `name` gets from the server's own (same names)."""
    fields = {f.name for f in dataclasses.fields(WorkerConfig)} - {"name", "path"}
    return WorkerConfig(name=name, path=path, **{f: getattr(config, f) for f in fields})


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Supervisor:
    def __init__(
        self,
        config: ServerConfig,
        address: str,
        token: str,
        # (model name, replica, reason, the ops a crashed worker was running)
        on_exit: Callable[[str, int, str, list[str]], None],
        # (model name, replica, reason): no worker of it is started again
        on_given_up: Callable[[str, int, str], None] = lambda *_: None,
        # (model name, replica) → how many workers of it have said HELLO so far
        attaches: Callable[[str, int], int] = lambda *_: 0,
    ):
        self.config = config
        self.address = address
        self.token = token
        self.on_exit = on_exit
        self.on_given_up = on_given_up
        self.attaches = attaches
        self.gpus = plan_gpus(config)  # before any worker starts: a bad --devices says so here
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self._lock = threading.Lock()  # stop() against a worker being started
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, path in self.config.models.items():
            for replica in range(self.config.replicas):
                thread = threading.Thread(
                    target=self._watch,
                    args=(name, path, replica),
                    name=f"supervise-{name}-{replica}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Let the workers finish (they drain on SIGTERM), then make sure they are gone: a
        worker still loading its model ends at once (it drains only once it serves)."""
        with self._lock:  # no worker starts after this
            self._stopping.set()
            procs = list(self.procs.values())
        timeout_s = timeout_s if timeout_s is not None else self.config.drain_timeout_s + 10
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self, name: str, path: str, replica: int) -> None:
        key = f"{name}#{replica}"
        restarts = Restarts(self.config.worker_start_tries)
        while True:
            started = time.monotonic()
            oom_kills = own_oom_kills()
            attaches = self.attaches(name, replica)
            with self._lock:
                if self._stopping.is_set():
                    return
                proc = self._spawn(name, path, replica)
                self.procs[key] = proc
            proc.wait()
            if self._stopping.is_set():
                return
            oom = oom_kills is not None and (own_oom_kills() or 0) > oom_kills
            served = self.attaches(name, replica) > attaches
            load_failure = self._load_failure(proc, name, replica, oom and not served)
            if load_failure is not None:
                reason, running = load_failure, []
            else:
                reason, running = self._why_exited(proc, name, replica, oom)
            self.on_exit(name, replica, reason, running)
            wait_s = restarts.after_exit(
                served, load_failure is not None, time.monotonic() - started
            )
            if wait_s is None:
                reason = given_up(reason, restarts.failures)
                log.error("%s (replica %d): %s; not starting it again", name, replica, reason)
                self.on_given_up(name, replica, reason)
                return
            log.error("%s (replica %d): %s; starting a new one", name, replica, reason)
            self.restarts[key] = self.restarts.get(key, 0) + 1
            self._stopping.wait(wait_s)

    def _load_failure(
        self, proc: subprocess.Popen, name: str, replica: int, oom: bool
    ) -> str | None:
        """The one-line reason a worker could not load its model (it left it, or the kernel's
        OOM killer ended it before it served), or None. A group's exit status is torchrun's:
        the reason a rank left says it."""
        reason = read_reason(self.load_failure_path(name, replica))
        if reason is not None and proc.returncode != 0:
            return reason
        if proc.returncode == EXIT_LOAD_FAILED:
            return f"cannot load model {name!r} (its worker exited with code {EXIT_LOAD_FAILED})"
        if oom:
            return (
                f"cannot load model {name!r}: not enough memory for its weights (the kernel's OOM "
                "killer ended its worker while it loaded); free memory or serve a smaller model"
            )
        return None

    def _why_exited(
        self, proc: subprocess.Popen, name: str, replica: int, oom: bool
    ) -> tuple[str, list[str]]:
        """How a worker ended, and the ops it was running if it crashed or the kernel's OOM
        killer killed it (`oom`: it killed a process of our memory cgroup meanwhile); any
        other SIGKILL came from outside and blames nothing. A group's exit status does not
        say how its ranks died: their crash logs do (the ops are in rank 0's recorder,
        which a broken group's rank 0 leaves as it was)."""
        code, group = proc.returncode, self.config.devices > 1
        recorder = self.recorder_path(name, replica)
        crash = read_crash(recorder, self.config.devices)
        if crash is not None:
            log.error("%s (replica %d): rank %d crashed:\n%s", name, replica, *crash)
        if not group and code < 0 and -code in CRASH_SIGNALS:
            how = f"crashed ({signal.Signals(-code).name})"
        elif group and crash is not None:
            rank, text = crash
            fatal = text.splitlines()[0].removeprefix("Fatal Python error: ")
            how = f"crashed (rank {rank}: {fatal})"
        elif oom and (group or code == -signal.SIGKILL):
            how = "was killed by the kernel's OOM killer (out of memory)"
        else:
            return f"worker process {proc.pid} exited with code {code}", []
        running = read_running(recorder)
        return f"worker process {proc.pid} {how} running {len(running)} ops", running

    def _spawn(self, name: str, path: str, replica: int) -> subprocess.Popen:
        data = Path(self.config.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        settings = self.config.model_dump(mode="json")
        settings["models"] = {name: path}
        config_file = data / f"worker-{_slug(name)}.json"
        config_file.write_text(json.dumps(settings))
        n = self.config.devices
        cmd = [sys.executable]
        if n > 1:
            cmd += ["-m", "torch.distributed.run", *group_args(n)]
        cmd += ["-m", "treadle.cli", "worker", "--config", str(config_file)]
        cmd += ["--connect", self.address, "--replica", str(replica)]
        env = self.environment(name, replica)
        clear_crash_logs(self.recorder_path(name, replica), n)
        self.load_failure_path(name, replica).unlink(missing_ok=True)
        gpus = f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if (name, replica) in self.gpus else ""
        log.info("starting the worker of %s%s%s", name, f" ({n} ranks)" if n > 1 else "", gpus)
        # a process group of its own: a Ctrl-C at the terminal reaches the server alone,
        # which drains its workers (SIGTERM) in its own time
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, process_group=0)

    def environment(self, name: str, replica: int) -> dict[str, str]:
        """The worker group's environment: this process's, the hub's token, its GPUs."""
        env = {**os.environ, TOKEN_ENV: self.token}
        env[FLIGHT_RECORDER_ENV] = str(self.recorder_path(name, replica))
        env[LOAD_FAILURE_ENV] = str(self.load_failure_path(name, replica))
        if (name, replica) in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[(name, replica)])
        n = self.config.devices
        if n > 1:  # torchrun's default is one thread per rank; CPU ranks share the cores
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        return env

    def recorder_path(self, name: str, replica: int) -> Path:
        return Path(self.config.data_dir) / f"worker-{_slug(name)}-{replica}.running"

    def load_failure_path(self, name: str, replica: int) -> Path:
        return Path(self.config.data_dir) / f"worker-{_slug(name)}-{replica}.failed"


def group_args(n: int) -> list[str]:
    """torchrun's flags for a group of n ranks on this machine: a rendezvous of its own on
    a free port, and no restarts of its own (the supervisor restarts the whole group)."""
    return ["--standalone", f"--nproc-per-node={n}", "--max-restarts=0"]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
