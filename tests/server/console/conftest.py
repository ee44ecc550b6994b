"""Fixtures of the console tests: a real `treadle serve` with tenants, a headless Chromium
(Debian's `chromium`, driven by Playwright), and where screenshots go.

The browser tests skip, saying why, when Chromium or Playwright is missing
(`apt-get install chromium`; `pip install -e ".[dev]"` brings Playwright). Playwright never
downloads a browser here: it launches the system's (TREADLE_CHROMIUM, else `chromium` on
PATH, else /usr/bin/chromium).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _inproc import InProcessServer

ROOT = Path(__file__).resolve().parents[3]
TINY = "treadle/tiny-llama"
PRICES = {TINY: {"prefill": 0.5, "sample": 2.0, "train": 3.0}}  # $ per million tokens


def chromium_path() -> str | None:
    found = os.environ.get("TREADLE_CHROMIUM") or shutil.which("chromium")
    found = found or shutil.which("chromium-browser") or "/usr/bin/chromium"
    return found if Path(found).exists() else None


# Module scope: Playwright's sync API keeps an event loop running in this thread while it is
# open, and later tests call asyncio.run.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        pytest.skip(
            "browser tests need Chromium: apt-get install chromium (or set TREADLE_CHROMIUM)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(
            "browser tests need Playwright: pip install -e '.[dev]' (or pip install playwright)"
        )
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's own sandbox cannot start
        chromium = p.chromium.launch(
            executable_path=path, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def shots_dir() -> Path:
    """Screenshots of every page, kept after the run (TREADLE_SCREENSHOTS, else
    runs/console-screenshots)."""
    where = Path(os.environ.get("TREADLE_SCREENSHOTS") or ROOT / "runs" / "console-screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def make_tenants(data_dir: Path, names: list[str], admins: list[str]) -> dict[str, str]:
    """Tenants (and an admin key for each of `admins`) in the database of a server on
    data_dir, before it starts; → name → key."""
    from treadle.server.storage.database import Store
    from treadle.server.tenancy import tenants

    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{data_dir.resolve() / 'treadle.db'}")
    try:
        keys = {}
        for name in names:
            tenants.create_tenant(store, name)
            keys[name], _ = tenants.create_key(store, name, admin=name in admins)
        return keys
    finally:
        store.close()


@pytest.fixture(scope="module")
def tenant_server(tiny_model_dir, tmp_path_factory) -> Iterator[InProcessServer]:
    """A server with tenants alice, bob and carol, and ops (whose key is an admin key)."""
    data = tmp_path_factory.mktemp("console")
    keys = make_tenants(data, ["alice", "bob", "carol", "ops"], admins=["ops"])
    server = InProcessServer(
        {TINY: tiny_model_dir}, data, config={"prices": PRICES}, startup_timeout_s=180
    ).start()
    server.keys = keys
    yield server
    server.stop()
