"""The cookbook's own virtualenv: the pinned `tinker` and `tinker-cookbook` releases from PyPI.

tinker-cookbook 0.5.8 pins transformers<=5.5.4, so it cannot share the project's virtualenv
(which stays on current transformers). It gets its own, built once under `.venv-compat/` in
the project root (ignored by git) and reused while its pins do not change. The current
cookbook (COOKBOOK_NEXT) lives in a folder of that venv, beside the pinned one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-compat"
STAMP = VENV / ".installed"

# torch first and pinned: the only CPU build reachable here; a bare `torch` would pull
# multi-GB CUDA wheels. math-rl brings the grading dependencies of recipes.math_rl.
TORCH = "torch==2.13.0"
COOKBOOK = os.environ.get("TREADLE_COMPAT_COOKBOOK", "0.5.8")
TINKER = os.environ.get("TREADLE_COMPAT_TINKER", "0.38.0")
PINS = [TORCH, f"tinker=={TINKER}", f"tinker-cookbook[math-rl]=={COOKBOOK}"]

# The current cookbook, next to the pinned one: 0.6.1 declares tml-renderers>=0.4.1, which
# the package index does not serve, but imports tml_renderers lazily (only for the Inkling and
# Kimi K3 models). Its other dependencies are those of 0.5.8, already in the venv (tinker
# 0.38 speaks its provenance spans and record_stability_info), so it is installed without
# dependencies into a folder of its own, put first on PYTHONPATH by the tests that run it.
COOKBOOK_NEXT = "0.6.1"

# pip output that means "the index cannot be reached", not "the pins are wrong"
OFFLINE_SIGNS = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
)


class VenvUnavailable(RuntimeError):
    """The package index cannot be reached, so the cookbook cannot be installed."""


def python() -> Path:
    return VENV / "bin" / "python"


def ensure() -> Path:
    """Build .venv-compat if it is missing or has other pins; → its python."""
    spec = "\n".join(PINS) + "\n"
    if STAMP.exists() and STAMP.read_text() == spec:
        return python()
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".venv-compat.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once build it once
        if STAMP.exists() and STAMP.read_text() == spec:
            return python()
        shutil.rmtree(VENV, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(VENV)])
        constraints = VENV / "constraints.txt"
        constraints.write_text(TORCH + "\n")
        pip = [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, TORCH])
        _run([*pip, "-c", str(constraints), *PINS])
        STAMP.write_text(spec)
    return python()


def next_cookbook() -> Path:
    """Install tinker-cookbook COOKBOOK_NEXT (no dependencies) beside the venv's own, once;
    → the folder to put first on PYTHONPATH."""
    ensure()
    target = VENV / f"cookbook-{COOKBOOK_NEXT}"
    stamp = target / ".installed"
    if stamp.exists():
        return target
    with open(ROOT / ".venv-compat.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        pip = [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", "--target", str(target), f"tinker-cookbook=={COOKBOOK_NEXT}"])
        stamp.write_text(COOKBOOK_NEXT + "\n")
    return target


def _run(cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode == 0:
        return
    out = (proc.stdout + proc.stderr)[-3000:]
    if any(sign in out for sign in OFFLINE_SIGNS):
        raise VenvUnavailable(f"{' '.join(cmd[-3:])}: the package index is unreachable:\n{out}")
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}")
