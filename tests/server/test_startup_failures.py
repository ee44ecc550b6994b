"""A model that cannot load, and signals whatever the workers are doing: real `treadle serve`
processes.

- Each start-up failure a restart cannot fix (no such path, a folder without config.json,
  no tokenizer, an architecture transformers does not know, weights that do not fit in
  memory) ends `treadle serve` with status 1 and one line on stderr that says why, without
  a traceback and without starting the worker again.
- SIGTERM ends the server within the drain timeout while a worker crash-loops or loads
  slowly; a second SIGTERM ends it at once, even while a worker refuses to drain.
- A model that served and then cannot load any more (its folder deleted) is given up after
  worker_start_tries tries: healthz and `treadle status` say it is down and why, its requests fail with
  the reason instead of waiting.

Workers are made slow or broken from outside the project's code: a `sitecustomize` module
on the server's PYTHONPATH, which Python runs at the start of every process (the workers
are `python -m treadle.cli worker ...` children).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from treadle.launch import free_port

TINY = "treadle/tiny-llama"

# Runs first in every process started with it on PYTHONPATH; acts in workers only.
HOOK = """
import os, signal, sys, time
_argv = " ".join(sys.orig_argv)
_marker = os.environ.get("HOOK_ARMED")  # a file: the hook acts only while it exists
if " worker " in f" {_argv} " and (_marker is None or os.path.exists(_marker)):
    _what = os.environ.get("HOOK", "")
    if _what == "crash":  # a worker that dies of a segfault before it serves
        os.kill(os.getpid(), signal.SIGSEGV)
    elif _what == "slow-load":  # reading the model's config.json takes 10 minutes
        def _slow(event, args):
            if event == "open" and str(args[0]).endswith("config.json"):
                time.sleep(600)
        sys.addaudithook(_slow)
    elif _what == "no-drain":  # a worker that ignores SIGTERM (it never drains)
        _signal = signal.signal
        def _ignore_term(sig, handler):
            return _signal(sig, signal.SIG_IGN if sig == signal.SIGTERM else handler)
        signal.signal = _ignore_term
"""


class Serve:
    """`treadle serve` as a child process, its stderr in a file."""

    def __init__(self, tmp: Path, model: Path | str, hook: str = "", config: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tmp / "data"
        self.stderr_path = tmp / "stderr.log"
        hooks = tmp / "hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "sitecustomize.py").write_text(HOOK)
        path = os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env = {**os.environ, "PYTHONPATH": path, "HOOK": hook, "PYTHONUNBUFFERED": "1"}
        self.cmd = [sys.executable, "-m", "treadle.cli", "serve", "--port", str(self.port)]
        self.cmd += ["--data-dir", str(self.data), "--model", f"{TINY}={model}"]
        if config:
            (tmp / "config.json").write_text(json.dumps(config))
            self.cmd += ["--config", str(tmp / "config.json")]
        self.proc: subprocess.Popen | None = None

    def start(self, preexec_fn=None, **env: str) -> Serve:
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**self.env, **env},
                preexec_fn=preexec_fn,
            )
        return self

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, text: str, count: int = 1, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stderr().count(text) < count:
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in time:\n{self.stderr()[-3000:]}"
            time.sleep(0.2)

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()[-3000:]
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not healthy in time:\n{self.stderr()[-3000:]}")

    def exit_status(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running after {timeout_s} s:\n{self.stderr()[-3000:]}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the server's whole tree (its workers are in groups of their own)."""
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


@pytest.fixture
def serve(tmp_path):
    started: list[Serve] = []

    def make(*args, **kwargs) -> Serve:
        started.append(Serve(tmp_path, *args, **kwargs))
        return started[-1]

    yield make
    for s in started:
        if s.proc is not None and s.proc.poll() is None:
            s.kill()


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def _model_copy(tiny_model_dir: Path, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    for name in drop:
        (dest / name).unlink()
    return dest


# ---- start-up failures -----------------------------------------------------------------------


def _missing(tmp: Path, tiny: Path) -> Path:
    return tmp / "no-such-model"


def _no_config(tmp: Path, tiny: Path) -> Path:
    return _model_copy(tiny, tmp / "no-config", drop=("config.json",))


def _no_tokenizer(tmp: Path, tiny: Path) -> Path:
    return _model_copy(tiny, tmp / "no-tokenizer", drop=("tokenizer.json", "tokenizer_config.json"))


def _unknown_arch(tmp: Path, tiny: Path) -> Path:
    out = _model_copy(tiny, tmp / "unknown-arch")
    config = json.loads((out / "config.json").read_text())
    config["model_type"], config["architectures"] = "frobnicator", ["FrobnicatorForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _too_big(tmp: Path, tiny: Path) -> Path:
    """Config and tokenizer are fine; the embedding (missing from the weights file, so
    allocated and initialised at load) needs 16 GB, over the server's 6 GB address space."""
    from safetensors.torch import load_file, save_file

    out = _model_copy(tiny, tmp / "too-big")
    weights = load_file(out / "model.safetensors")
    del weights["model.embed_tokens.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = 32_000_000  # x hidden 128 x 4 bytes
    (out / "config.json").write_text(json.dumps(config))
    return out


def _six_gb_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.parametrize(
    "make_model, says",
    [
        (_missing, "is not found; give --model NAME=PATH"),
        (_no_config, "must be a model folder with config.json"),
        (_no_tokenizer, "its tokenizer does not load"),
        (_unknown_arch, "unsupported architecture"),
        (_too_big, "not enough memory for its weights"),
    ],
    ids=["missing-path", "no-config", "no-tokenizer", "unknown-arch", "out-of-memory"],
)
def test_a_model_that_cannot_load_stops_the_server_at_start(
    serve, tmp_path, tiny_model_dir, make_model, says
):
    model = make_model(tmp_path, tiny_model_dir)
    limit = _six_gb_address_space if make_model is _too_big else None
    server = serve(model).start(preexec_fn=limit)
    status = server.exit_status(timeout_s=240)
    err = server.stderr()
    assert status == 1, err[-3000:]
    last = _last_line(err)
    assert last.startswith(f"treadle serve: cannot load model {TINY!r}"), err[-3000:]
    assert says in last, last
    assert "Traceback" not in err, err[-5000:]
    assert err.count("starting the worker of") <= 1  # never started again
    with pytest.raises(httpx.TransportError):  # nothing ever listened there
        httpx.get(f"{server.url}/api/v1/healthz", timeout=2)


# ---- signals ------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_during_a_crash_loop_at_start(serve, tiny_model_dir, sig):
    server = serve(tiny_model_dir, hook="crash", config={"drain_timeout_s": 5}).start()
    server.wait_for("starting a new one", count=2)  # the third worker is starting
    sent = time.monotonic()
    server.proc.send_signal(sig)
    assert server.exit_status(timeout_s=5) == 0, server.stderr()[-3000:]
    assert time.monotonic() - sent < 5
    assert _last_line(server.stderr()) == "treadle serve: stopped before it started serving"
    assert "Traceback" not in server.stderr()


def test_sigterm_during_a_slow_load_at_start(serve, tiny_model_dir):
    server = serve(tiny_model_dir, hook="slow-load", config={"drain_timeout_s": 5}).start()
    server.wait_for("starting the worker of")
    time.sleep(3)  # the worker is importing, then stuck reading config.json
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_status(timeout_s=5) == 0, server.stderr()[-3000:]
    assert time.monotonic() - sent < 5
    assert "Traceback" not in server.stderr()
    assert not _descendants(server.proc.pid)


def test_sigterm_while_a_restarted_worker_loads_slowly(serve, tmp_path, tiny_model_dir):
    """After start-up: the worker dies, its successor hangs loading; SIGTERM still ends
    the server within the drain timeout."""
    armed = tmp_path / "armed"
    server = serve(tiny_model_dir, hook="slow-load", config={"drain_timeout_s": 5})
    server.start(HOOK_ARMED=str(armed))
    server.wait_healthy()
    armed.touch()  # the next worker loads slowly
    (worker,) = _descendants(server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    server.wait_for("starting a new one")
    time.sleep(3)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_status(timeout_s=5 + 15) == 0, server.stderr()[-3000:]
    assert time.monotonic() - sent < 5 + 15
    assert "Traceback" not in server.stderr()


def test_a_second_sigterm_stops_the_server_at_once(serve, tiny_model_dir):
    """The worker ignores SIGTERM, so the first one waits out the drain (30 s and more);
    the second ends the server, and its worker, at once."""
    server = serve(tiny_model_dir, hook="no-drain").start()
    server.wait_healthy()
    (worker,) = _descendants(server.proc.pid)
    server.proc.send_signal(signal.SIGTERM)
    server.wait_for("Waiting for application shutdown")
    time.sleep(1)
    assert server.proc.poll() is None  # still waiting for its worker to drain
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_status(timeout_s=3) == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 3
    assert "SIGTERM again: stopping at once" in _last_line(server.stderr())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{worker}").exists() and _state(worker) != "Z":
        assert time.monotonic() < deadline, "the worker outlived the server"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


# ---- a model that served, then cannot load ----------------------------------------------------


def test_a_model_deleted_under_its_worker_is_given_up_and_reported_down(
    serve, tmp_path, tiny_model_dir
):
    from treadle import AdamParams, ServiceClient
    from treadle.client.errors import APIError

    model = _model_copy(tiny_model_dir, tmp_path / "model")
    server = serve(model, config={"worker_start_tries": 2}).start()
    server.wait_healthy()
    svc = ServiceClient(base_url=server.url)
    tc = svc.create_lora_training_client(TINY, rank=4)
    shutil.rmtree(model)
    (worker,) = _descendants(server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    server.wait_for("not starting it again", timeout_s=400)
    health = httpx.get(f"{server.url}/api/v1/healthz", timeout=10)
    assert health.status_code == 503
    (reason,) = health.json()["models_down"].values()
    assert "is not found" in reason and "gave up after 2 workers" in reason, reason
    status = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--base-url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert f"{TINY} (replica 0) is down: {reason}" in status.stdout
    assert " down " in status.stdout
    started = time.monotonic()
    with pytest.raises(APIError, match="is down: cannot load model"):
        tc.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
    assert time.monotonic() - started < 30  # failed with the reason, not after a timeout
    svc.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_status(timeout_s=60) == 0


# ---- worker threads (--engine-processes false) ----------------------------------------------


def test_a_worker_thread_that_cannot_load_ends_the_start_up(tmp_path, tiny_model_dir):
    """The in-process app: the engine factory raising is a load failure, said once."""
    from fastapi.testclient import TestClient

    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig
    from treadle.server.engines.startup import CannotStart

    made = []

    def no_memory(name: str, path: str, config: ServerConfig):
        made.append(name)
        raise MemoryError("tried to allocate 16384000000 bytes")

    config = ServerConfig(
        models={TINY: str(tiny_model_dir)}, data_dir=str(tmp_path), engine_processes=False
    )
    started = time.monotonic()
    with pytest.raises(CannotStart, match="not enough memory for its weights"):
        with TestClient(create_app(config, engine_factory=no_memory)):
            pass
    assert made == [TINY]  # not tried again
    assert time.monotonic() - started < 60
