"""An engine worker process: the Engine, its loop and executor, and a socket to the API.

    treadle worker --model treadle/tiny-llama=.models/tiny-llama --connect tcp://127.0.0.1:5555
    torchrun --nproc-per-node 2 -m treadle.cli worker --model ... --connect ...   # a group

The worker loads its model, connects to the API's hub (treadle.server.runtime.remote) and
says HELLO with the hub's token (TREADLE_WORKER_TOKEN). It then runs the ops it is sent
through the same EngineLoop the in-process mode uses, and sends back outcomes, sampler-ref
changes and state snapshots. It writes checkpoint rows to the database itself (as the
in-process engine thread does), so it needs the server's --data-dir / --db.

An engine fault (treadle.server.runtime.faults: a device left unusable, or the engine loop
dead) ends the process at once with EXIT_ENGINE_FAULT, after telling the API which ops were
running; nothing is failed here, since the API runs the acknowledged ops again on the new
worker its supervisor starts.

If the API goes silent (no heartbeat for API_SILENT_S), or says it does not know this
worker, the worker says HELLO again until it is welcomed; being welcomed again makes it
drop every model first, since the API restores them all from its database. SIGTERM or SHUTDOWN: run what
is queued (up to drain_timeout_s), write every model's state, exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

import zmq

from treadle.errors import ErrorInfo
from treadle.server.config import ServerConfig
from treadle.server.runtime import messages
from treadle.server.runtime.channel import TICK_S, Channel
from treadle.server.runtime.checkpoint_writer import CheckpointWriter
from treadle.server.runtime.engine_client import EngineFacts, SnapshotPolicy
from treadle.server.runtime.engine_loop import EngineLoop
from treadle.server.runtime.executor import OpExecutor
from treadle.server.runtime.faults import EXIT_ENGINE_FAULT, EngineFault
from treadle.server.runtime.journal import Journal
from treadle.server.runtime.live_weights import StateSnapshot
from treadle.server.runtime.messages import Kind
from treadle.server.runtime.ops import Outcome, Progress
from treadle.server.runtime.remote import TOKEN_ENV
from treadle.server.storage.database import Store
from treadle.worker.flight_recorder import FLIGHT_RECORDER_ENV, FlightRecorder, keep_crash_log

log = logging.getLogger("treadle.worker")

API_SILENT_S = 2.0
HELLO_EVERY_S = 1.0


class Worker:
    def __init__(
        self,
        config: ServerConfig,
        name: str,
        path: str,
        address: str,
        token: str,
        replica: int = -1,
        engine: Any = None,
    ):
        """`engine`: what the executor calls (default: an Engine of the config's model); a
        worker group's rank 0 passes its DistributedEngine (treadle.worker.group)."""
        from treadle.server.app import default_engine_factory, park_limits

        self.config = config
        self.token = token
        self.replica = replica
        self.worker_id = uuid.uuid4().hex[:12]
        if engine is None:
            engine = default_engine_factory(name, path, config)
        self.store = Store(config.resolved_db_url)
        self.journal = Journal(self.store.engine)
        writer = CheckpointWriter(engine, self.store, self.journal, config.artifacts_dir)
        executor = OpExecutor(
            engine,
            writer,
            config.max_snapshots_per_model,
            state_root=config.state_dir,
            on_refs=self._refs,
        )
        self.facts = EngineFacts.of(name, engine)
        recorder_path = os.environ.get(FLIGHT_RECORDER_ENV)
        self.recorder = FlightRecorder(recorder_path) if recorder_path else None
        self.loop = EngineLoop(
            self.facts,
            executor,
            self._outcomes,
            config.max_sample_batch,
            max_merge_tokens=config.max_merge_tokens,
            on_snapshot=self._snapshot if config.durable else None,
            snapshots=SnapshotPolicy(config.snapshot_every_steps, config.snapshot_every_s),
            report_replays=True,
            park=park_limits(config),
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
        self._epoch: str | None = None
        self._welcomed = False
        self._api_seen = time.monotonic()
        self._last_hello = 0.0
        self._last_beat = 0.0
        self._done = threading.Event()
        self._draining = False

    # ---- life ----
    def run(self) -> None:
        self.journal.start()
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
            self.journal.stop()
            self.channel.stop()
            self.store.close()
            self._done.set()

        threading.Thread(target=drain, name="drain", daemon=True).start()

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
        if self._welcomed:
            return  # a duplicate (two HELLOs crossed)
        if self._epoch is not None:
            # welcomed again (a restarted API, or one that lost track of us): it restores
            # every model from its records, so start from nothing
            log.warning("welcomed again: forgetting every model (the API restores them)")
            self.loop.control("reset").result()
        self._epoch, self._welcomed = welcome.epoch, True

    def _call(self, call: messages.Call) -> None:
        if call.name == "add_model":  # here, in order: the model's first op comes right after
            self.loop.add_model(**call.args)
            self._send(Kind.REPLY, messages.Reply(call.call_id))
            return

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
            self.channel.send([Kind.HEARTBEAT.encode(), b""])

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        engine = self.loop.executor.engine
        device = getattr(engine, "placement", None) or str(getattr(engine, "device", "cpu"))
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        if device.startswith("cuda") and gpus:  # which of the machine's GPUs, for status
            device += f" [GPU {gpus}]"
        hello = messages.Hello(
            self.worker_id, self.facts, self.token, self.replica, pid=os.getpid(), device=device
        )
        self._send(Kind.HELLO, hello)

    # ---- what the engine says (its thread) ----
    def _outcomes(self, outcomes: list[Outcome]) -> None:
        body = messages.encode_outcomes(outcomes, self.loop.positions())
        self.channel.send([Kind.OUTCOMES.encode(), body])

    def _progress(self, items: list[Progress]) -> None:
        self._send(Kind.PROGRESS, messages.ProgressMsg(items))

    def _refs(self, added: list[str], dropped: list[str]) -> None:
        self._send(Kind.REFS, messages.Refs(added, dropped))

    def _snapshot(self, snap: StateSnapshot) -> None:
        self._send(Kind.SNAPSHOT, snap)

    def _fault(self, fault: EngineFault) -> None:
        """Engine thread: the engine cannot go on in this process. Say which ops were
        running, wait (briefly) for that to leave, and exit."""
        ids = fault.running_ids
        if self.recorder is not None:
            self.recorder.clear()  # said here: the supervisor must not blame them again
        log.critical("engine fault with %d ops running: %s; exiting", len(ids), fault)
        body = messages.encode(messages.Fault(ids, str(fault)))
        self.channel.send([Kind.FAULT.encode(), body])
        self.channel.stop(timeout_s=1.0, linger_s=2.0)
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAULT)

    def _send(self, kind: Kind, obj: Any) -> None:
        self.channel.send([kind.encode(), messages.encode(obj)])


def run_worker(
    config: ServerConfig, address: str, token: str | None = None, replica: int = -1
) -> None:
    """`treadle worker`: serve the config's one model until SIGTERM (then drain) or SIGKILL.

    Under torchrun with several processes, this process is one rank of a worker group
    (treadle.worker.group)."""
    from treadle.worker.group import in_group, run_group

    (name, path), *more = config.models.items()
    if more:
        raise SystemExit("treadle worker: serves exactly one --model NAME=PATH")
    keep_crash_log(int(os.environ.get("RANK", "0")))
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    if in_group():
        run_group(config, address, token, replica)
        return
    worker = Worker(config, name, path, address, token, replica)
    signal.signal(signal.SIGTERM, lambda *_: worker.drain_and_exit())
    worker.run()
