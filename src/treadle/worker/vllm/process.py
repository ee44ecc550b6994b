"""The worker's handle on its vLLM process: start it, talk to it, notice when it dies.

The process runs treadle/worker/vllm/driver.py under the vLLM virtualenv's python (so that
vLLM's pinned versions never constrain Treadle's), connected to one zmq PAIR socket this
side binds on an ipc path of its own. Only the engine thread uses a VllmProcess.

A death (the process ended, or the socket broke) raises VllmDied from whatever call saw it;
the sampler (treadle.worker.vllm.batch) then moves the requests it held to Treadle's own
decode batch and starts a new process in the background.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

log = logging.getLogger("treadle.vllm")

DRIVER = Path(__file__).with_name("driver.py")


PYTHON_ENV = "TREADLE_VLLM_PYTHON"


def find_python(given: str | None = None) -> str:
    """The vLLM virtualenv's python: `given`, else $TREADLE_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working folder or in the source checkout (`make vllm-venv`)."""
    candidates = [given, os.environ.get(PYTHON_ENV)]
    candidates += [str(Path.cwd() / ".venv-vllm/bin/python")]
    candidates += [str(Path(__file__).resolve().parents[4] / ".venv-vllm/bin/python")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise FileNotFoundError(
        "sampler vllm needs the vLLM virtualenv: build it with `make vllm-venv`, or name its "
        f"python with --vllm-python or ${PYTHON_ENV}"
    )


class VllmDied(RuntimeError):
    """The vLLM process ended or stopped answering."""


@dataclass(frozen=True)
class VllmSettings:
    """How the vLLM process is started (ServerConfig's vllm_* fields)."""

    python: str  # the vLLM virtualenv's interpreter
    model: str  # the served model's folder
    dtype: str = "float32"
    max_loras: int = 4  # LoRA slots in one batch (one of them the zero adapter of base rows)
    max_lora_rank: int = 64
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_logprobs: int = 64
    kv_cache_gb: float = 1.0
    seed: int = 0
    startup_timeout_s: float = 600.0

    def engine_args(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_cpu_loras": max(self.max_loras, 64),  # pushed snapshots stay loaded
            "max_lora_rank": self.max_lora_rank,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_logprobs": self.max_logprobs,
            # logprobs of the raw logits, before temperature / top-k / top-p: Treadle's
            "logprobs_mode": "raw_logprobs",
            "enable_prefix_caching": True,
            "kv_cache_memory_bytes": int(self.kv_cache_gb * (1 << 30)),
            "seed": self.seed,
        }


class VllmProcess:
    """One running vLLM process (start() waits until its engine is up)."""

    def __init__(self, settings: VllmSettings):
        self.settings = settings
        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0
        self._dir = tempfile.mkdtemp(prefix="treadle-vllm-")
        self._log_path = Path(self._dir) / "vllm.log"
        self._pending: list[dict] = []  # events read while waiting for an ack

    # ---- life ----
    def start(self) -> VllmProcess:
        s = self.settings
        address = f"ipc://{self._dir}/sock"
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores, as torch does
        cmd = [s.python, str(DRIVER), "--socket", address, "--settings"]
        cmd.append(json.dumps(s.engine_args()))
        logf = open(self._log_path, "ab")  # noqa: SIM115 (the child writes to it for its life)
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        logf.close()
        t0 = time.monotonic()
        while True:
            msg = self._recv(timeout_s=1.0)
            if msg is not None and msg["ev"] == "ready":
                self.startup_s = time.monotonic() - t0
                log.info("vLLM process %d up in %.1f s", self.proc.pid, self.startup_s)
                return self
            if msg is not None and msg["ev"] == "failed":
                self.stop()
                raise VllmDied(f"the vLLM engine did not start:\n{msg['error']}")
            if time.monotonic() - t0 > s.startup_timeout_s:
                self.stop()
                raise VllmDied(f"the vLLM process did not start in {s.startup_timeout_s:g} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.sock.send_json({"op": "stop"}, zmq.NOBLOCK)  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- messages ----
    def send(self, msg: dict) -> None:
        if not self.alive():
            raise VllmDied(self._death())
        self.sock.send_json(msg)  # type: ignore[union-attr]

    def call(self, msg: dict, timeout_s: float = 120.0) -> None:
        """Send a LoRA op and wait for its ack (other events read meanwhile are kept)."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ev = self._recv(timeout_s=0.5)
            if ev is None:
                continue
            if ev["ev"] == "ack" and ev["op"] == msg["op"] and ev["id"] == msg["id"]:
                if not ev["ok"]:
                    raise RuntimeError(ev["error"])
                return
            self._pending.append(ev)
        raise VllmDied(f"the vLLM process did not answer {msg['op']} in {timeout_s:g} s")

    def events(self, timeout_s: float) -> list[dict]:
        """Events waiting, or the first to arrive within timeout_s (→ [] if none)."""
        out, self._pending = self._pending, []
        first = self._recv(timeout_s=0 if out else timeout_s)
        while first is not None:
            out.append(first)
            first = self._recv(timeout_s=0)
        return out

    def _recv(self, timeout_s: float) -> dict | None:
        if self.sock is None:
            raise VllmDied("the vLLM process was stopped")
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_json()
        if not self.alive():
            raise VllmDied(self._death())
        return None

    def _death(self) -> str:
        code = self.proc.poll() if self.proc is not None else None
        return f"the vLLM process ended (exit code {code}); its log ends:\n{self.log_tail()}"


class Restarter:
    """Starts a VllmProcess on a thread of its own, so that the engine thread (which
    samples on Treadle's engine meanwhile) never waits for vLLM's startup."""

    def __init__(self, settings: VllmSettings):
        self.settings = settings
        self._result: VllmProcess | Exception | None = None
        self._thread: threading.Thread | None = None
        self.failures = 0

    def begin(self) -> None:
        if self._thread is not None:
            return

        def run() -> None:
            try:
                self._result = VllmProcess(self.settings).start()
            except Exception as e:  # reported by take()
                self._result = e

        self._thread = threading.Thread(target=run, name="vllm-start", daemon=True)
        self._thread.start()

    def take(self) -> VllmProcess | None:
        """The started process once it is up (None: still starting, or it failed)."""
        if self._thread is None or self._thread.is_alive():
            return None
        result, self._result, self._thread = self._result, None, None
        if isinstance(result, Exception):
            self.failures += 1
            log.error("the vLLM process could not start (try %d): %s", self.failures, result)
            return None
        return result

    def wait(self) -> VllmProcess | None:
        """Wait for a start under way to end: → the process it started, if it did."""
        if self._thread is not None:
            self._thread.join()
        return self.take()

    @property
    def starting(self) -> bool:
        return self._thread is not None
