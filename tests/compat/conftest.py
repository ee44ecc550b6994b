"""Fixtures of the cookbook compatibility tests.

The cookbook runs unmodified in its own virtualenv (compat_venv), as a child process pointed
at a real `treadle serve` (the shared `treadle_server`) by environment variables only:
TINKER_BASE_URL, TINKER_API_KEY, and an offline Hugging Face cache that `treadle hf-cache`
filled with the served model's tokenizer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import compat_venv
import pytest

API_KEY = "tml-treadle-compat"  # the SDK insists on the tml- prefix; any value works


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    try:
        return compat_venv.ensure()
    except compat_venv.VenvUnavailable as e:
        pytest.skip(f"cannot install tinker-cookbook from the package index: {e}")


@pytest.fixture(scope="session")
def hf_home(treadle_server, tmp_path_factory) -> Path:
    """An HF_HOME whose hub cache holds the served model's tokenizer, placed by the CLI."""
    home = tmp_path_factory.mktemp("hf-home")
    name, path = next(iter(treadle_server.models.items()))
    cmd = [sys.executable, "-m", "treadle.cli", "hf-cache", "--model", f"{name}={path}"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HOME": str(home)}, timeout=60)
    return home


@pytest.fixture(scope="session")
def cookbook_env(treadle_server, hf_home) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return keep | {
        "TINKER_BASE_URL": treadle_server.url,
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="session")
def next_cookbook(cookbook_python) -> Path:
    """The folder holding tinker-cookbook COOKBOOK_NEXT (put first on PYTHONPATH)."""
    try:
        return compat_venv.next_cookbook()
    except compat_venv.VenvUnavailable as e:
        pytest.skip(f"cannot install tinker-cookbook {compat_venv.COOKBOOK_NEXT}: {e}")


@pytest.fixture
def run_cookbook(cookbook_python, cookbook_env, tmp_path) -> Callable[..., str]:
    """run_cookbook(*args, timeout=240, path=None) → combined output; fails the test on a
    non-zero exit. `path`: a folder put first on PYTHONPATH (another cookbook release)."""

    def run(*args: str, timeout: float = 240, path: Path | None = None) -> str:
        env = cookbook_env if path is None else {**cookbook_env, "PYTHONPATH": str(path)}
        proc = subprocess.run(
            [str(cookbook_python), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, (
            f"{' '.join(args[:3])} exited {proc.returncode}:\n{out[-6000:]}"
        )
        return out

    return run
