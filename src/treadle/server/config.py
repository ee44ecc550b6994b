"""Settings of `treadle serve`: one pydantic model, a docstring and a default per field.

The docstrings are the help of the generated command-line flags (`serve_flags`), so the
names, help and defaults live in one place.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from treadle.server.tenancy.quotas import Quotas


def parse_model_arg(arg: str) -> tuple[str, str]:
    """`NAME=PATH` → (NAME, PATH); a bare `PATH` is named after its folder.

    NAME may contain '/' (HF-style ids such as `treadle/tiny-llama`), so the split is on the
    first '=' only, and a bare path whose folder name itself holds '=' still works when it
    exists on disk.
    """
    if "=" in arg and not Path(arg).exists():
        name, path = arg.split("=", 1)
        if not name or not path:
            raise ValueError(f"--model: expected NAME=PATH or PATH, got {arg!r}")
        return name, path
    path = Path(arg)
    return (path.stem if path.is_file() else path.resolve().name), arg


# What a cached prompt token costs against a computed one, unless a price says otherwise:
# it skips the prefill's compute but holds memory (Tinker bills cache hits at a fraction too).
CACHED_PREFILL_FRACTION = 0.25


class Price(BaseModel):
    """$ per million tokens of one base model, per metered counter."""

    prefill: float = 0.0
    sample: float = 0.0
    train: float = 0.0
    cached_prefill: float | None = None
    """Prompt tokens the sampler's prefix cache held; None: CACHED_PREFILL_FRACTION of
    prefill."""

    @property
    def cached_prefill_rate(self) -> float:
        if self.cached_prefill is None:
            return self.prefill * CACHED_PREFILL_FRACTION
        return self.cached_prefill


class InputLimits(BaseModel):
    """What one request may ask of the server, whoever sends it (400 / 413 beyond)."""

    max_seq_len: dict[str, int] = {}
    """Per served model name: the longest sequence (a datum, or a prompt plus its
    max_tokens); never more than the model's own context length."""
    max_batch_tokens: int | None = None
    """Tokens of one forward/forward_backward request (its model inputs summed)."""
    max_num_samples: int = 256
    """num_samples of one sample request."""
    max_sample_tokens: int | None = None
    """max_tokens of one sample request; a request without max_tokens gets this much room
    (or the room its model's context leaves, whichever is less)."""
    max_body_bytes: int = 64 << 20
    """Bytes of one forward_backward body, received or decompressed (413 beyond); the SDKs
    send chunks of about 5 MB."""
    max_json_body_bytes: int = 4 << 20
    """Bytes of any JSON request body (413 beyond, refused before it is parsed). JSON is
    parsed on the event loop; this bound keeps one parse to tens of milliseconds."""
    max_import_bytes: int = 8 << 30
    """Bytes of one uploaded adapter archive (checkpoint import), streamed to disk."""
    max_request_cells: int = 1 << 24
    """Numbers in the loss_fn_inputs of one forward_backward request, or in a sample
    request's target_prompt_logprobs table, counted before they are allocated (a sparse
    tensor declares a large shape in a few bytes)."""
    max_result_cells: int = 1 << 20
    """(token id, logprob) cells one sample request may ask for: top-K prompt and sample
    logprobs and alternative prompt tokens, counted from the request before sampling."""


class ServerConfig(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    models: dict[str, str]
    """Served base models: name (what clients pass as base_model) → a local HF model folder
    or a .gguf file (dequantised at load)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    data_dir: str = "./treadle-data"
    """Holds the SQLite database (unless db_url is given) and artifacts/<run_id>/..."""
    db_url: str | None = None
    """SQLAlchemy URL; None → sqlite:///<data_dir>/treadle.db."""
    dtype: str = "float32"
    """Base model weights dtype: float32 or bfloat16."""
    device: str = "cpu"
    """Where the engines run: cpu, cuda, cuda:1, ... (a worker group's rank r on a machine
    uses cuda:LOCAL_RANK)."""
    devices: int = 1
    """Ranks of each served model's worker group on this machine: N > 1 starts the worker
    under `torchrun --nproc-per-node N` (NCCL over N GPUs, or gloo over N CPU processes):
    the rows of each call are split across the ranks, gradients summed."""
    shard: str = "none"
    """How a worker group holds the frozen base: none (a whole copy per rank) or fsdp
    (FSDP2 fully_shard: each rank keeps 1/N, for a model larger than one device)."""
    heartbeat_timeout_s: float = 120.0
    """A session silent this long (the SDK beats every 10 s) is ended and its adapters freed."""
    long_poll_s: float = 30.0
    """How long retrieve_future holds a poll before answering try_again (the SDK waits 45 s)."""
    max_snapshots_per_model: int = 8
    """In-memory sampler snapshots kept per training model; older ones are freed."""
    max_sample_batch: int = 64
    """Sample requests decoding together at most (more wait to join the decode batch)."""
    max_merge_tokens: int = 65536
    """Consecutive forward/forward_backward requests of one model (the chunks of a big batch)
    share one engine call up to this many tokens; the first always runs."""
    max_parked_ops: int = 1024
    """Requests of one training model held while they wait for an earlier seq_id that has
    not arrived (a gap); one more is refused at once with an error naming this bound."""
    max_parked_bytes: int = 1 << 30
    """Bytes of the data those parked requests hold, per training model (same refusal)."""
    parked_op_timeout_s: float = 600.0
    """How long a parked request waits for the seq_id it needs; past it, it fails with an
    error naming the missing seq_id, and the model carries on after it."""
    log_level: str = "info"
    """debug, info, warning or error."""
    engine_processes: bool = True
    """Run each served model's engine in a worker process of its own, started, watched and
    restarted by the server (false: on a thread of the API process)."""
    replicas: int = 1
    """Worker groups per served model: a session is placed on one for its life; a group
    down longer than failover_after_s has its sessions moved to another."""
    failover_after_s: float = 10.0
    """How long a replica may be down before its sessions move to a serving one."""
    start_workers: bool = True
    """Start the workers (false: wait for `treadle worker --connect` processes)."""
    worker_address: str = "tcp://127.0.0.1:0"
    """Where workers connect (port 0: a free port on loopback, for the workers the server
    starts itself). Workers on other machines need a reachable address and the token."""
    worker_token: str | None = None
    """The secret a worker must present (default: $TREADLE_WORKER_TOKEN, else random)."""
    worker_start_tries: int = 5
    """Workers in a row that may end before they serve (a crash at load, a model that no
    longer loads) before their model is given up: reported down, its requests failed with
    the reason. A model that never served and cannot load is not tried again at all."""
    engine_down_timeout_s: float = 120.0
    """Requests waiting for a model whose worker is gone this long fail (EngineDeadError)."""
    durable: bool = True
    """Keep the op log and state snapshots, so that a crash loses nothing acknowledged
    (false: a crash loses every session's state since its last save_state; benchmarks)."""
    snapshot_every_steps: int = 10
    """A model's state (adapter, AdamW, accumulated gradients) is written every this many
    optimizer steps, so that recovery replays at most that many."""
    snapshot_every_s: float = 60.0
    """... or this long after its first change since the last snapshot."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: how long acknowledged work may still run before the state is written."""
    quotas: Quotas = Quotas()
    """Every tenant's default quotas (unset: unlimited); see treadle.server.tenancy.quotas."""
    tenant_quotas: dict[str, Quotas] = {}
    """Per tenant name: quotas over the defaults (the database's, set with `treadle admin
    set-quotas`, win over these)."""
    rate_window_s: float = 60.0
    """The sliding window of the requests_per_minute quota (60; tests shorten it)."""
    auth_cache_ttl_s: float = 5.0
    """How long an API key's tenant (or its revocation), and that no tenant exists yet, are
    trusted before the database is read again (in a worker thread, never on the event
    loop): `treadle admin revoke-key` stops a key within this time."""
    console: bool = True
    """Serve the web console (/console, its JSON under /api/v1/treadle/console) and record
    its figures and request timeline (false: no console routes, recorder or static files;
    spend caps and TrainingClient.log_metrics work either way)."""
    prices: dict[str, Price] = {}
    """Per served model name: $ per million prefill / sample / train tokens (usage reports)."""
    activation_checkpointing: str = "auto"
    """Checkpoint the decoder layers of a forward_backward: off; on (each layer keeps only
    its input and backward runs it again: about a third more compute for a fraction of the
    activation memory); auto (on for a call whose estimated activations exceed
    checkpoint_above_gb)."""
    prefix_cache_gb: float = 0.25
    """Memory of each engine's prefix cache: the prompt KV of earlier sample requests,
    reused by later ones that start alike (the next turn, the next request on one prompt),
    per tenant and weights version, least recently used first out; 0 turns it off."""
    memory_budget_gb: float | None = None
    """GiB an engine process may use at the peak of a forward/forward_backward, weights
    included (estimated from the model's config before the call runs): a longer sequence
    than fits is refused with a 400 naming its length and the limit, and a call too large
    for one pass runs as several. Default 90 % of the device's memory (total RAM on a CPU,
    total GPU memory on CUDA)."""
    checkpoint_above_gb: float | None = None
    """auto checkpointing: checkpoint a call whose estimated activations exceed this many
    GiB (default a quarter of the budget left after the weights)."""
    max_context: int | None = None
    """Accept sequences up to this many tokens on every served model, past its own context
    length (positions it was not trained on: RoPE runs there, with whatever quality the
    model has); default each model's context."""
    metrics_networks: str = ""
    """Comma-separated networks (e.g. 10.1.2.0/24) whose clients may read GET /metrics
    (Prometheus) without a key; from anywhere else it takes an admin key. Empty (the
    default): an admin key always, once tenants exist. Never name the address a reverse
    proxy forwards tenants' requests from (often 127.0.0.1)."""
    metrics_max_tenants: int = 50
    """Tenants that get a label of their own on the per-tenant metrics (the first ones seen);
    the tokens of any later tenant are counted under tenant="other"."""
    otel_endpoint: str | None = None
    """Export OpenTelemetry traces over OTLP/HTTP to this URL (e.g. http://collector:4318),
    from the API process and its workers: a trace per request (unset: the standard
    OTEL_EXPORTER_OTLP_ENDPOINT; neither: tracing off). Needs treadle[otel]."""
    jwt_auth: bool = False
    """Tell the tinker SDK to exchange its API key for a short-lived token first (POST
    /api/v1/auth/token, its pjwt_auth_enabled) and send that instead; the exchange itself
    works either way, and a token is accepted in place of its key until it expires."""
    jwt_ttl_s: float = 3600.0
    """How long a token from /api/v1/auth/token is accepted."""
    batch_polling: bool = True
    """The tinker SDK's samplers wait for their results through one long poll per sampling
    client (retrieve_futures) and a copy of a sampling client joins its session for a
    clone number of its own (join_sampling_session)."""
    checkpoint_sweep_s: float = 30.0
    """How often checkpoints past their TTL are deleted (their files; the row stays and
    says so)."""
    storage_price: float = 0.0
    """USD per GB-month of checkpoint storage (billing/usage reports; 0: not charged)."""
    upload_url_ttl_s: float = 3600.0
    """How long the signed URLs of an external-weights upload stay valid."""
    sampler: str = "torch"
    """What samples: torch (Treadle's own sampler, exact against the trainer) or vllm (a
    vLLM process per worker, for GPUs, behind the parity gate; needs the vLLM virtualenv:
    `make vllm-venv`, docs/sampling-backends.md). Scoring stays on Treadle's engine."""
    vllm_python: str | None = None
    """The python of the vLLM virtualenv (default: $TREADLE_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working folder or the source checkout)."""
    vllm_max_loras: int = 4
    """LoRAs vLLM runs in one batch (one slot is the zero adapter of base-model rows);
    requests of more wait in vLLM's own queue."""
    vllm_max_lora_rank: int = 64
    """The highest LoRA rank vLLM serves; a snapshot of a higher rank samples on Treadle."""
    vllm_kv_cache_gb: float = 1.0
    """GiB of vLLM's KV cache (on a CPU: of RAM)."""
    parity_gate: bool = True
    """With sampler vllm: check vLLM's logprobs against Treadle's engine on every snapshot's
    first results and then periodically; a snapshot over the threshold samples on Treadle."""
    parity_max_abs: float | None = None
    """The gate's largest per-token |logprob difference| (nats); mean and KL bounds scale
    with it. Default per dtype: 1e-3 float32, 0.3 bfloat16."""
    limits: InputLimits = InputLimits()

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, v: str) -> str:
        if v not in ("torch", "vllm"):
            raise ValueError(f"sampler must be torch or vllm, got {v!r}")
        return v

    @field_validator("models")
    @classmethod
    def _some_models(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("models: serve at least one model (NAME=PATH)")
        return v

    @field_validator("devices", "worker_start_tries")
    @classmethod
    def _at_least_one(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("shard")
    @classmethod
    def _known_shard(cls, v: str) -> str:
        if v not in ("none", "fsdp"):
            raise ValueError(f"shard must be none or fsdp, got {v!r}")
        return v

    @model_validator(mode="after")
    def _groups_are_processes(self) -> ServerConfig:
        if self.devices > 1 and not self.engine_processes:
            raise ValueError(
                f"devices {self.devices} needs engine_processes true (a worker group is "
                "torchrun processes), got engine_processes false"
            )
        if self.sampler == "vllm" and self.devices > 1:
            raise ValueError(
                f"sampler vllm runs one vLLM process beside a one-process worker; devices "
                f"{self.devices} (a worker group) needs sampler torch"
            )
        return self

    @field_validator("auth_cache_ttl_s")
    @classmethod
    def _not_negative(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("activation_checkpointing")
    @classmethod
    def _known_checkpointing(cls, v: str) -> str:
        if v not in ("off", "on", "auto"):
            raise ValueError(f"activation_checkpointing must be off, on or auto, got {v!r}")
        return v

    @field_validator("prefix_cache_gb")
    @classmethod
    def _prefix_cache_not_negative(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"must be >= 0 (0: off), got {v}")
        return v

    @field_validator("memory_budget_gb", "checkpoint_above_gb", "max_context")
    @classmethod
    def _positive_or_unset(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator(
        "heartbeat_timeout_s",
        "long_poll_s",
        "parked_op_timeout_s",
        "jwt_ttl_s",
        "checkpoint_sweep_s",
        "upload_url_ttl_s",
    )
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{Path(self.data_dir).resolve() / 'treadle.db'}"

    @property
    def artifacts_dir(self) -> Path:
        return Path(self.data_dir).resolve() / "artifacts"

    @property
    def state_dir(self) -> Path:
        """Where engines write state snapshots (treadle.server.core.recovery)."""
        return self.artifacts_dir / ".state"


# Flags kept from before they were generated; the generated `--db-url` works too.
FLAG_ALIASES = {"db_url": ["--db"]}
CHOICES = {
    "dtype": ["float32", "bfloat16"],
    "log_level": ["debug", "info", "warning", "error"],
    "shard": ["none", "fsdp"],
    "activation_checkpointing": ["off", "on", "auto"],
    "sampler": ["torch", "vllm"],
}


def serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per scalar ServerConfig field (`data_dir` → `--data-dir`), its docstring as
    help; a flag left out keeps the config file's value or the field's default."""
    for name, field in ServerConfig.model_fields.items():
        kind = _scalar_type(field.annotation)
        if kind is None:
            continue  # dicts and nested settings come from --model and --config
        flags = [f"--{name.replace('_', '-')}", *FLAG_ALIASES.get(name, [])]
        help_text = f"{field.description or ''} (default {field.default!r})".strip()
        parser.add_argument(
            *flags,
            dest=name,
            type=kind,
            choices=CHOICES.get(name),
            default=None,
            help=help_text.replace("%", "%%"),
        )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields given as flags."""
    return {
        name: getattr(args, name)
        for name in ServerConfig.model_fields
        if getattr(args, name, None) is not None
    }


def _scalar_type(annotation: Any) -> Any:
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    kinds = [a for a in options if a is not type(None)] or [annotation]
    if len(kinds) == 1 and kinds[0] in (str, int, float):
        return kinds[0]
    if kinds == [bool]:
        return _boolean
    return None


def _boolean(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
