"""What the worker knows of its vLLM process: which requests it may take, which LoRA each
snapshot is there, and the process's life (started in the background, restarted after a
death). Runs on the engine thread.

LoRA names and ids: every immutable set of weights (a sampler snapshot `snap:...`, a pin
of a live adapter `pin:...`, a checkpoint loaded for sampling) gets its own vLLM LoRA,
named `<key>@<id>` with an id never used before in that process, so vLLM's prefix cache
(keyed by LoRA id) never reuses blocks across weight versions. It is pushed as a PEFT
folder (written by the engine's own exporter into a temporary folder) when the snapshot is
kept, or on its first request, and removed when the snapshot is freed.

Base-model rows run with a zero adapter (B = 0: its update is exactly zero): vLLM 0.32's CPU
LoRA kernels give base rows that sit in a batch beside adapter rows another adapter's
update, so no row is ever without an adapter there.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.engine.types import LoraSpec, SampledSeq, SampleRequest
from treadle.worker.vllm.gate import ParityGate
from treadle.worker.vllm.process import Restarter, VllmDied, VllmProcess, VllmSettings

log = logging.getLogger("treadle.vllm")

ZERO = "vllm:zero"  # the engine id of the zero adapter while it is written
BASE = "base"  # the gate's key of the base model
RESTART_AFTER_S = (1.0, 5.0, 30.0, 120.0)  # waits before the 1st, 2nd, ... restart


class VllmSampler:
    def __init__(self, engine: Any, settings: VllmSettings, gate: ParityGate):
        self.engine = engine
        self.settings = settings
        self.gate = gate
        self.process: VllmProcess | None = None
        self.restarter = Restarter(settings)
        self.loras: dict[str | None, tuple[int, Path]] = {}  # key → (LoRA id, its folder)
        self.unsupported: dict[str, str] = {}  # key → why vLLM cannot serve it
        self._ids = itertools.count(1)
        self._dir = Path(tempfile.mkdtemp(prefix="treadle-vllm-loras-"))
        self._restart_at = 0.0
        self._failures = 0  # deaths and failed starts: each waits longer to restart
        self.deaths = 0
        # whether an engine id names weights that never change (the executor's rule: its
        # snapshots, pins and sampler refs); a live training adapter is never pushed
        self.is_frozen: Callable[[str], bool] = lambda key: key.startswith(("snap:", "pin:"))
        self.routed = 0  # sample requests vLLM took
        self.fell_back = 0  # requests it held that Treadle's sampler ran instead
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache held (summed over samples)

    def counts(self) -> dict[str, int]:
        """Counters since the worker started (its heartbeat's `sampler`, then /metrics)."""
        return {
            "vllm_samples": self.routed,
            "fell_back": self.fell_back,
            "parity_checks": self.gate.checks,
            "parity_trips": len(self.gate.tripped) + self.gate.forgotten_trips,
            "vllm_deaths": self.deaths,
            "vllm_cached_prompt_tokens": self.cached_tokens,
        }

    # ---- life ----
    def start(self, wait: bool = False) -> None:
        """Start the process in the background (wait: until it is up)."""
        self.restarter.begin()
        if wait:
            while self.restarter.starting:
                if self.up():
                    return
                time.sleep(0.2)
            if not self.up():
                raise VllmDied("the vLLM process did not start (see the log above)")

    def up(self) -> bool:
        """Whether a process serves now (adopting one the restarter has started)."""
        if self.process is not None:
            return True
        if not self.restarter.starting:
            self._maybe_restart()
            return False
        proc = self.restarter.take()
        if proc is None:
            if not self.restarter.starting:  # it could not start: try again later
                self._schedule_restart()
            return False
        self.process = proc
        self._failures = 0
        try:
            self.loras[None] = self._push(None)
        except VllmDied as e:
            self.died(e)
            return False
        return True

    def died(self, error: Exception) -> None:
        """The process is gone: forget its LoRAs, restart it after a pause."""
        log.error("the vLLM sampler died; Treadle's sampler takes its requests: %s", error)
        self.deaths += 1
        if self.process is not None:
            self.process.stop()
        self.process = None
        for _, folder in self.loras.values():
            shutil.rmtree(folder, ignore_errors=True)
        self.loras.clear()
        self._schedule_restart()

    def _schedule_restart(self) -> None:
        self._failures += 1
        wait = RESTART_AFTER_S[min(self._failures, len(RESTART_AFTER_S)) - 1]
        self._restart_at = time.monotonic() + wait

    def _maybe_restart(self) -> None:
        if self._failures and time.monotonic() >= self._restart_at:
            self.restarter.begin()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        started = self.restarter.wait()  # one starting now would outlive the worker
        if started is not None:
            started.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- routing ----
    def takes(self, req: SampleRequest) -> bool:
        """Whether vLLM samples this request: one that generates, asks nothing vLLM cannot
        give exactly (prompt logprobs: vLLM 0.32's CPU LoRA logits kernel fails on them;
        target ids and alternative prompt tokens are Treadle's own), on weights the gate
        has not tripped, while the process is up."""
        if req.params.max_tokens <= 0 or req.prompt_logprobs or req.topk_prompt_logprobs:
            return False
        if _beyond_mapping(req.params):
            return False
        if req.target_prompt_ids is not None or req.prompt_alt_tokens_k:
            return False
        if req.topk_sample_logprobs > self.settings.max_logprobs:
            return False
        if len(req.prompt) + req.params.max_tokens > self.settings.max_model_len:
            return False
        if req.adapter is not None and not self.is_frozen(req.adapter):
            return False
        key = gate_key(req.adapter)
        if not self.gate.allows(key) or key in self.unsupported:
            return False
        return self.up()

    def lora_of(self, adapter: str | None) -> int | None:
        """The vLLM LoRA id serving `adapter` (pushed now if it is not there yet), or None
        when it cannot be (the reason kept in `unsupported`)."""
        if adapter in self.loras:
            return self.loras[adapter][0]
        try:
            self.loras[adapter] = self._push(adapter)
        except VllmDied:
            raise
        except Exception as e:  # too high a rank, a layer vLLM cannot adapt, ...
            self.unsupported[gate_key(adapter)] = f"{type(e).__name__}: {e}"
            log.warning("vLLM cannot serve %s; Treadle's sampler will: %s", adapter, e)
            return None
        return self.loras[adapter][0]

    def push(self, key: str) -> None:
        """A new snapshot: load it into vLLM now, if the process is up (else on first use)."""
        if self.process is not None and key not in self.loras:
            try:
                self.lora_of(key)
            except VllmDied as e:
                self.died(e)

    def forget(self, key: str) -> None:
        """The snapshot is freed: remove its LoRA (its id is never used again)."""
        self.gate.forget(gate_key(key))
        self.unsupported.pop(key, None)
        entry = self.loras.pop(key, None)
        if entry is None:
            return
        lora_id, folder = entry
        shutil.rmtree(folder, ignore_errors=True)
        if self.process is not None:
            try:
                self.process.call({"op": "remove_lora", "id": lora_id})
            except VllmDied as e:
                self.died(e)
            except RuntimeError:
                log.exception("vLLM could not remove LoRA %d (%s)", lora_id, key)

    def _push(self, adapter: str | None) -> tuple[int, Path]:
        lora_id = next(self._ids)
        folder = self._dir / f"{lora_id}"
        if adapter is None:  # the zero adapter: a fresh one (B = 0), written and dropped
            self.engine.create_adapter(ZERO, LoraSpec(rank=1, alpha=1.0))
            try:
                self.engine.save_adapter(ZERO, folder)
            finally:
                self.engine.drop_adapter(ZERO)
        else:
            self.engine.save_adapter(adapter, folder)
        assert self.process is not None
        name = f"{adapter or BASE}@{lora_id}"
        try:
            self.process.call({"op": "add_lora", "name": name, "id": lora_id, "path": str(folder)})
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return lora_id, folder


def _beyond_mapping(spec: Any) -> bool:
    """Settings the mapping onto vLLM's parameters does not carry (batch.py `_params`):
    sampling controls (min_p, logit_bias, penalties, constraints) and sequences that report
    their shaped distribution's logprobs beside the raw ones (`shapes`), where a SampleSpec
    has them; Treadle's sampler runs those requests."""
    return bool(
        getattr(spec, "has_controls", False)
        or getattr(spec, "min_p", 0.0)
        or (getattr(spec, "shapes", False) and hasattr(SampledSeq, "sampling_logprobs"))
    )


def gate_key(adapter: str | None) -> str:
    return BASE if adapter is None else adapter
