"""A run folder: config.json (enough to repeat the run), metrics.jsonl, checkpoints.jsonl.

Re-opening the same folder resumes: the last checkpoint record says where to start.
MLflow logging is optional: it is used when `mlflow` is installed and a tracking URI is given.
Weights & Biases likewise, when a `wandb_project` is given (and `wandb_name`, the run's
name; default: the folder's): the run's config, then every step's metrics (WANDB_MODE=offline
writes them under the run folder's wandb/ instead of sending them).
Each step's metrics also go to the server (`TrainingClient.log_metrics`) once a training
client is attached, so that its console shows them beside the server's own figures; and
with the service client, each step's metered cost (cost/step_usd, cost/total_usd).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from tqdm import tqdm

from treadle.cookbook.estimate import CostMeter
from treadle.errors import InvalidRequestError

log = logging.getLogger("treadle.cookbook")


class RunDir:
    def __init__(
        self,
        path: str | Path,
        config: Any,
        mlflow_uri: str | None = None,
        wandb_project: str | None = None,
        wandb_name: str | None = None,
    ):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
        self._check_or_write_config()
        self._mlflow = (
            _start_mlflow(mlflow_uri, self.path.name, self.config) if mlflow_uri else None
        )
        self._wandb = (
            _start_wandb(wandb_project, wandb_name or self.path.name, self.config, self.path)
            if wandb_project
            else None
        )
        self._client = None  # the training client whose server also gets the metrics
        self._report_failed = False
        self.service = None  # the service client (its usage: the metered cost)
        self.session_id: str | None = None  # its server session (the usage report's key)
        self._meter: CostMeter | None = None

    def attach(self, training_client, service=None) -> None:
        """Report every step's metrics to this client's server too (its console), with the
        metered cost so far when the service client is given."""
        self._client = training_client
        if service is not None:
            self.service, self._meter = service, CostMeter(service)
            self.session_id = getattr(service, "session_id", None)

    def close(self) -> None:
        """Finish the trackers' runs (W&B writes its summary then)."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _check_or_write_config(self) -> None:
        config_path = self.path / "config.json"
        if config_path.exists():
            saved = json.loads(config_path.read_text())
            # A resumed run must be the same run: a changed knob would silently mix two runs.
            changed = {
                k for k in set(saved) | set(self.config) if saved.get(k) != self.config.get(k)
            }
            changed -= {"max_steps"}  # extending a run is allowed
            if changed:
                raise InvalidRequestError(
                    f"{config_path} was written with other settings ({sorted(changed)}); "
                    "use a new run folder or the same settings"
                )
        config_path.write_text(json.dumps(self.config, indent=2, default=str) + "\n")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._meter is not None:
            metrics = {**metrics, **self._meter.step()}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._mlflow:
            self._mlflow.log_metrics(
                {k.replace(":", "_"): v for k, v in metrics.items()}, step=step
            )
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        report = getattr(self._client, "log_metrics", None)  # the tinker SDK has none
        if report is not None and not self._report_failed:
            try:
                report(step, metrics)
            except Exception as e:  # noqa: BLE001 - the run goes on; its folder has them
                self._report_failed = True
                log.warning("the server did not take the metrics (%s); not sending more", e)

    def metrics(self) -> list[dict[str, float]]:
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def log_checkpoint(self, step: int, **paths: str) -> None:
        with open(self.path / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **paths}) + "\n")

    def last_checkpoint(self) -> dict[str, Any] | None:
        path = self.path / "checkpoints.jsonl"
        if not path.exists():
            return None
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return records[-1] if records else None

    def truncate_metrics_after(self, step: int) -> None:
        """Drop metric lines of steps after `step`: they are repeated after a resume."""
        kept = [m for m in self.metrics() if m["step"] <= step]
        (self.path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))


def step_bar(desc: str, start: int, total: int) -> tqdm:
    """The steps still to run, as a progress bar that shows the resumed ones as done."""
    return tqdm(range(start, total), desc=desc, initial=start, total=total, dynamic_ncols=True)


def step_rng(seed: int, step: int) -> random.Random:
    """The data of a step depends only on (seed, step), so a resumed run sees the same data."""
    return random.Random(seed * 1_000_003 + step)


def open_training_client(
    svc,
    run: RunDir,
    model: str,
    lora_rank: int,
    lora_alpha: float | None,
    seed: int,
    load_checkpoint_path: str | None = None,
    load_optimizer: bool = False,
) -> tuple[Any, int, dict[str, Any] | None]:
    """Resume from the run's last checkpoint (weights and optimizer; metrics of the steps after
    it are dropped, they will run again), or start a session: from `load_checkpoint_path`'s
    weights (and its Adam moments with `load_optimizer`), or a fresh adapter. Returns (training client, first step, checkpoint record)."""
    last = run.last_checkpoint()
    start = 0
    if last is not None:
        run.truncate_metrics_after(last["step"] - 1)
        client = svc.create_training_client_from_state_with_optimizer(last["state_path"])
        start = last["step"]
    elif load_checkpoint_path and load_optimizer:
        client = svc.create_training_client_from_state_with_optimizer(load_checkpoint_path)
    elif load_checkpoint_path:
        client = svc.create_training_client_from_state(load_checkpoint_path)
    else:
        client = svc.create_lora_training_client(model, rank=lora_rank, alpha=lora_alpha, seed=seed)
    run.attach(client, svc)
    return client, start, last


def _start_mlflow(uri: str, run_name: str, config: dict[str, Any]):
    try:
        import mlflow
    except ImportError:
        return None
    mlflow.set_tracking_uri(uri)
    mlflow.start_run(run_name=run_name)
    mlflow.log_params({k: str(v)[:250] for k, v in config.items()})
    return mlflow


def _start_wandb(project: str, name: str, config: dict[str, Any], path: Path):
    try:
        import wandb
    except ImportError:
        log.warning("wandb_project is set but wandb is not installed (pip install wandb)")
        return None
    # resume="allow" under the folder's own id: a resumed run goes on in the same W&B run
    run_id = f"{name}-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    return wandb.init(
        project=project, name=name, id=run_id, config=config, dir=str(path), resume="allow"
    )
