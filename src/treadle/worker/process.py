"""An engine worker: the Engine, its loop and executor, and a socket to the API.

    treadle worker --model treadle/tiny-llama=.models/tiny-llama --connect tcp://127.0.0.1:5555
    torchrun --nproc-per-node 2 -m treadle.cli worker --model ... --connect ...   # a group

The worker loads its model, connects to the API's hub (treadle.server.engines.hub) and says
HELLO with the hub's token (TREADLE_WORKER_TOKEN). It then runs the ops it is sent through
its EngineLoop (treadle.worker.loop), and sends back outcomes, sampler-ref changes and state
snapshots. It writes checkpoint files and state snapshots under the data folder, and no
database rows: a save's rows travel on its outcome (treadle.worker.checkpoints).

A worker is a process of its own (`treadle serve` starts one per model, `treadle worker`
runs one anywhere), or a thread of the API process (`--engine-processes false`, the tests'
in-process app): the same code over an in-process socket.

An engine fault (treadle.protocol.faults: a device left unusable, or the engine loop dead)
ends the worker at once, after telling the API which ops were running (a process exits
with EXIT_ENGINE_FAULT); nothing is failed here, since the API runs the acknowledged ops
again on the new worker its supervisor starts.

A model that does not load ends the process with EXIT_LOAD_FAILED and its one-line reason
(treadle.protocol.load_failure), and no traceback for a user's mistake (a wrong path, an
unknown architecture, no tokenizer, too little memory): the supervisor reports it.

If the API goes silent (no heartbeat for API_SILENT_S), or says it does not know this
worker, the worker says HELLO again until it is welcomed. An API that took it anew (it had
restarted, or lost the worker) restores every model from its database, so the worker drops
them all first; one that had kept it (it was only slow: a busy machine) says so
(Welcome.restores false), and the worker goes on with everything it holds. SIGTERM or
SHUTDOWN: run what is queued (up to drain_timeout_s), write every model's state, stop.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq

from treadle.errors import ErrorInfo
from treadle.protocol import messages, tracing
from treadle.protocol.channel import TICK_S, Channel
from treadle.protocol.facts import EngineFacts, StateSnapshot
from treadle.protocol.faults import EXIT_ENGINE_FAULT, EngineFault
from treadle.protocol.flight_recorder import FLIGHT_RECORDER_ENV, FlightRecorder, keep_crash_log
from treadle.protocol.load_failure import (
    EXIT_LOAD_FAILED,
    LOAD_FAILURE_ENV,
    expected,
    reason_of,
    write_reason,
)
from treadle.protocol.messages import Kind
from treadle.protocol.ops import Outcome, Progress
from treadle.protocol.worker_config import TOKEN_ENV, WorkerConfig
from treadle.worker.checkpoints import CheckpointWriter
from treadle.worker.executor import OpExecutor
from treadle.worker.loop import EngineLoop
from treadle.worker.scheduler import ParkLimits

log = logging.getLogger("treadle.worker")

API_SILENT_S = 2.0
HELLO_EVERY_S = 1.0


def load_engine(config: WorkerConfig, device: str | None = None) -> Any:
    """The config's model as an Engine (on `device`, default the config's), with its memory
    settings (treadle.engine.memory) and context length."""
    from treadle.engine.engine import Engine
    from treadle.engine.memory import MemorySettings

    def gib(v: float | None) -> int | None:
        return None if v is None else int(v * (1 << 30))

    memory = MemorySettings(
        config.activation_checkpointing,
        gib(config.memory_budget_gb),
        gib(config.checkpoint_above_gb),
    )
    return Engine(
        config.path,
        dtype=config.dtype,
        device=device or config.device,
        model_name=config.name,
        memory=memory,
        max_seq_len=config.max_context,
        prefix_cache_bytes=int(config.prefix_cache_gb * (1 << 30)),
    )


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        address: str,
        token: str,
        replica: int = -1,
        engine: Any = None,
        in_thread: bool = False,
    ):
        """`engine`: what the executor calls (default: an Engine of the config's model); a
        worker group's rank 0 passes its DistributedEngine (treadle.worker.group).
        `in_thread`: a thread of the API process, which a fault ends without ending it."""
        self.config = config
        self.token = token
        self.replica = replica
        self.in_thread = in_thread
        self.worker_id = uuid.uuid4().hex[:12]
        engine = engine if engine is not None else load_engine(config)
        writer = CheckpointWriter(engine, config.artifacts_dir)
        self.vllm = None
        if config.sampler == "vllm":  # its process starts in the background
            from treadle.worker.vllm import vllm_sampler

            self.vllm = vllm_sampler(config, engine)
        executor = OpExecutor(
            engine,
            writer,
            config.max_snapshots_per_model,
            state_root=config.state_dir,
            on_refs=self._refs,
            vllm=self.vllm,
        )
        self.facts = EngineFacts.of(config.name, engine)
        recorder_path = None if in_thread else os.environ.get(FLIGHT_RECORDER_ENV)
        self.recorder = FlightRecorder(recorder_path) if recorder_path else None
        park = ParkLimits(
            config.max_parked_ops, config.max_parked_bytes, config.parked_op_timeout_s
        )
        self.loop = EngineLoop(
            self.facts,
            executor,
            self._outcomes,
            config.max_sample_batch,
            max_merge_tokens=config.max_merge_tokens,
            on_snapshot=self._snapshot if config.durable else None,
            snapshots=config.snapshots,
            park=park,
            on_progress=self._progress,
            on_fault=self._fault,
            on_running=self.recorder.record if self.recorder is not None else None,
        )
        self.channel = Channel(
            zmq.DEALER,
            self._on_message,
            self._on_tick,
            connect=address,
            identity=self.worker_id.encode(),
        )
        self.fault: EngineFault | None = None  # what ended this worker, if a fault did
        self._epoch: str | None = None
        self._welcomed = False
        self._api_seen = time.monotonic()
        self._last_hello = 0.0
        self._last_beat = 0.0
        self._done = threading.Event()
        self._draining = False

    # ---- life ----
    def run(self) -> None:
        """Serve until drained (SIGTERM, SHUTDOWN) or ended by a fault."""
        self.loop.start()
        self.channel.start()
        self._hello()
        log.info(
            "worker %s for %s connected to %s",
            self.worker_id,
            self.facts.name,
            self.channel.address,
        )
        self._done.wait()

    def drain_and_exit(self) -> None:
        """Run what is queued (up to drain_timeout_s), write every model's state, stop."""
        if self._draining:
            return
        self._draining = True

        def drain() -> None:
            deadline = time.monotonic() + self.config.drain_timeout_s
            while self.loop.busy() and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                self.loop.control("snapshot_all").result(timeout=self.config.drain_timeout_s)
            except Exception:
                log.exception("final snapshots failed")
            self.loop.stop()
            if self.vllm is not None:
                self.vllm.stop()
            self.channel.stop()
            self._done.set()

        threading.Thread(target=drain, name="drain", daemon=True).start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the worker has ended (within timeout_s)."""
        return self._done.wait(timeout_s)

    # ---- the socket (the channel's IO thread) ----
    def _on_message(self, frames: list[bytes]) -> None:
        kind, body = Kind(frames[0].decode()), frames[1]
        self._api_seen = time.monotonic()
        if kind == Kind.OP:
            self.loop.submit(messages.decode_op(body))
        elif kind == Kind.CALL:
            self._call(messages.decode(body, messages.Call))
        elif kind == Kind.WELCOME:
            self._welcome(messages.decode(body, messages.Welcome))
        elif kind == Kind.REJOIN and self._welcomed:
            self._welcomed = False
            self._hello()
        elif kind == Kind.SHUTDOWN:
            self.drain_and_exit()

    def _welcome(self, welcome: messages.Welcome) -> None:
        if welcome.restores and self._epoch is not None:
            # taken anew (a restarted API, or one that lost track of us): it restores
            # every model from its records, so start from nothing
            log.warning("welcomed anew: forgetting every model (the API restores them)")
            self.loop.control("reset").result()
        elif self._welcomed:
            return  # a duplicate (two HELLOs crossed)
        # else welcomed as we are (we only thought the API silent): the API restores
        # nothing, so every model, queued op and decoding row stays
        self._epoch, self._welcomed = welcome.epoch, True

    def _call(self, call: messages.Call) -> None:
        def reply(fut: Any) -> None:
            error = fut.exception()
            value = None if error is not None else fut.result()
            info = ErrorInfo.of(error) if error is not None else None
            self._send(Kind.REPLY, messages.Reply(call.call_id, value, info))

        self.loop.control(call.name, **call.args).add_done_callback(reply)

    def _on_tick(self) -> None:
        now = time.monotonic()
        if self._welcomed and now - self._api_seen > API_SILENT_S:
            log.warning("the API has been silent for %.1f s: saying hello again", API_SILENT_S)
            self._welcomed = False
        if not self._welcomed and now - self._last_hello > HELLO_EVERY_S:
            self._hello()
        if now - self._last_beat >= TICK_S:
            self._last_beat = now
            # the beat carries the loop's figures (the API's metrics: treadle.server.observe)
            self.channel.send([Kind.HEARTBEAT.encode(), messages.encode(self.loop.stats())])

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        engine = self.loop.executor.engine
        device = getattr(engine, "placement", None) or str(getattr(engine, "device", "cpu"))
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        if device.startswith("cuda") and gpus:  # which of the machine's GPUs, for status
            device += f" [GPU {gpus}]"
        pid = 0 if self.in_thread else os.getpid()
        hello = messages.Hello(
            self.worker_id, self.facts, self.token, self.replica, pid=pid, device=device
        )
        self._send(Kind.HELLO, hello)

    # ---- what the engine says (its thread) ----
    def _outcomes(self, outcomes: list[Outcome]) -> None:
        self.channel.send([Kind.OUTCOMES.encode(), messages.encode_outcomes(outcomes)])

    def _progress(self, items: list[Progress]) -> None:
        self._send(Kind.PROGRESS, messages.ProgressMsg(items))

    def _refs(self, added: list[str], dropped: list[str]) -> None:
        self._send(Kind.REFS, messages.Refs(added, dropped))

    def _snapshot(self, snap: StateSnapshot) -> None:
        self._send(Kind.SNAPSHOT, snap)

    def _fault(self, fault: EngineFault) -> None:
        """Engine thread: the engine cannot go on in this worker. Say which ops were
        running, wait (briefly) for that to leave, and end: a process exits, a thread
        stops (its supervisor starts a new worker either way)."""
        ids = fault.running_ids
        if self.recorder is not None:
            self.recorder.clear()  # said here: the supervisor must not blame them again
        log.critical("engine fault with %d ops running: %s; ending the worker", len(ids), fault)
        body = messages.encode(messages.Fault(ids, str(fault)))
        self.channel.send([Kind.FAULT.encode(), body])
        self.channel.stop(timeout_s=1.0, linger_s=2.0)
        if self.vllm is not None:
            self.vllm.stop()
        if not self.in_thread:
            logging.shutdown()
            os._exit(EXIT_ENGINE_FAULT)
        self.fault = fault
        self._done.set()

    def _send(self, kind: Kind, obj: Any) -> None:
        self.channel.send([kind.encode(), messages.encode(obj)])


def run_worker(
    config: WorkerConfig, address: str, token: str | None = None, replica: int = -1
) -> None:
    """`treadle worker`: serve the config's model until SIGTERM (then drain) or SIGKILL.

    Under torchrun with several processes, this process is one rank of a worker group
    (treadle.worker.group)."""
    from treadle.worker.group import in_group, run_group

    keep_crash_log(int(os.environ.get("RANK", "0")))
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    # spans of the engine calls, children of the API's request spans (off without endpoint)
    tracing.setup(tracing.endpoint_of(config.otel_endpoint), "treadle-worker")
    try:
        if in_group():
            run_group(config, address, token, replica)
            return
        with model_loading(config):
            engine = load_engine(config)
        worker = Worker(config, address, token, replica, engine=engine)
        for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C on a worker started by hand
            signal.signal(sig, lambda *_: worker.drain_and_exit())
        worker.run()
    finally:
        tracing.shutdown()  # its last spans
    gc.freeze()  # drained: the interpreter's last collections over torch would take seconds


@contextlib.contextmanager
def model_loading(config: WorkerConfig) -> Iterator[None]:
    """A worker process loading its model: a failure ends the process with EXIT_LOAD_FAILED
    and its one-line reason, left for the supervisor (or printed, for `treadle worker` run
    by hand); a traceback only for an error no user's mistake explains. A Ctrl-C while
    loading ends it quietly."""
    try:
        yield
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - whatever it is, the model is not served
        if not expected(e):
            log.exception("loading %s", config.name)
        reason = reason_of(e, config.name, config.path)
        if os.environ.get(LOAD_FAILURE_ENV):
            write_reason(reason)  # the supervisor says it, once
        else:
            print(f"treadle worker: {reason}", file=sys.stderr)
        logging.shutdown()
        os._exit(EXIT_LOAD_FAILED)  # no interpreter teardown: threads torch may have started
