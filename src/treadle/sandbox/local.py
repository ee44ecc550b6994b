"""Run untrusted Python in a bubblewrap box, limited and timed: the local sandbox.

Boundaries, outermost first (found once per process by `probe_isolation`, see README):
  1. the box (box.py): bubblewrap with its own root holding only the interpreter, the
     standard library and the run's scratch, new mount/pid/net/ipc/uts/cgroup namespaces, no
     capabilities, a fresh unprivileged uid when the server is root, a seccomp filter;
  2. a per-run cgroup (cgroup.py): total memory (tmpfs included) and number of processes;
  3. size-capped tmpfs for the scratch folder, /tmp and /dev/shm;
  4. rlimits per process: address space, CPU seconds, processes, file size, open files;
  5. the wall-clock timeout (the whole run is killed) and capped stdout/stderr.
The audit hook in _runner.py only makes verdicts clearer (`blocked`); it is no boundary.

Without a working bubblewrap, `LocalSandbox` refuses to start, unless `unsafe=True`: then runs
are plain processes with layers 2, 4 and 5 (and the hook) only, able to read and write
whatever the server can.

Here: what this machine allows (probe_isolation) and LocalSandbox; one run, its process and
its limits (SandboxLimits) are in process.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from pathlib import PurePosixPath

from treadle.errors import InvalidRequestError
from treadle.sandbox import box
from treadle.sandbox.cgroup import CgroupRoots, find_cgroups
from treadle.sandbox.process import SandboxLimits, _Run
from treadle.sandbox.types import RunResult, SandboxUnavailableError

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "install it with `apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` "
    "(Fedora/RHEL), `apk add bubblewrap` (Alpine) or `pacman -S bubblewrap` (Arch)"
)
UNSAFE_HINT = (
    "To run untrusted code with no isolation at all (it can then read and write whatever the "
    "server can), pass LocalSandbox(..., unsafe=True), or --unsafe_local_sandbox true to the "
    "code_rl recipe."
)


@dataclass(frozen=True)
class Isolation:
    """What this machine allows; found once by `probe_isolation`."""

    box: box.BoxLayout | None  # None: no usable bubblewrap (see `problem`)
    cgroups: CgroupRoots | None  # None: rlimits only
    problem: str = ""  # why there is no box

    def describe(self) -> str:
        parts = [self.box.describe() if self.box else "NO BOX (unsafe: a plain process)"]
        parts.append(self.cgroups.describe() if self.cgroups else "no cgroup (rlimits only)")
        return "; ".join(parts)


_probe_lock = threading.Lock()
_probed: Isolation | None = None


def probe_isolation() -> Isolation:
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def _probe() -> Isolation:
    cgroups = find_cgroups()
    bwrap = box.find_bwrap()
    if bwrap is None:
        problem = (
            f"The local sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}."
        )
        return Isolation(None, _check_cgroups(cgroups), problem)
    features = box.bwrap_features(bwrap)
    missing = [f for f in box.REQUIRED_FEATURES if f not in features]
    if missing:
        problem = (
            f"{bwrap} is too old for the local sandbox (it has no {', '.join(missing)}); "
            f"update it: {INSTALL_HINT}."
        )
        return Isolation(None, _check_cgroups(cgroups), problem)
    layout = box.plan_box(bwrap, features)
    if not layout.sized_tmpfs and not (cgroups and cgroups.memory):
        problem = (
            f"{bwrap} cannot cap a tmpfs (--size, bubblewrap 0.8+) and there is no memory "
            f"cgroup to bound it; update bubblewrap: {INSTALL_HINT}."
        )
        return Isolation(None, cgroups, problem)
    for groups in [cgroups, None] if cgroups else [None]:
        iso = Isolation(layout, groups)
        result = _probe_run(iso)
        if result.ok:
            return iso
    problem = (
        f"bubblewrap is installed but could not start a sandbox here ({result.status}: "
        f"{result.stderr.strip()[-400:]}). In a container, allow unprivileged user namespaces "
        "or run the server as root with CAP_SYS_ADMIN."
    )
    return Isolation(None, _check_cgroups(cgroups), problem)


def _check_cgroups(cgroups: CgroupRoots | None) -> CgroupRoots | None:
    if cgroups is None:
        return None
    return cgroups if _probe_run(Isolation(None, cgroups)).ok else None


def _probe_run(iso: Isolation) -> RunResult:
    limits = SandboxLimits(timeout_s=20.0, cpu_s=10, memory_mb=512)
    return _Run(iso, limits, audit=True).run({"main.py": "import json, os"}, "", 20.0)


class LocalSandbox:
    """Runs programs with `limits`, at most `workers` at once (`submit` from any thread).

    Without a working bubblewrap it raises SandboxUnavailableError, unless `unsafe`; `audit`
    turns the audit hook (clearer `blocked` verdicts, no boundary) on or off."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        workers: int = 4,
        audit: bool = True,
        unsafe: bool = False,
    ):
        self.limits = limits or SandboxLimits()
        self.audit = audit
        self.isolation = probe_isolation()
        if self.isolation.box is None:
            if not unsafe:
                raise SandboxUnavailableError(f"{self.isolation.problem} {UNSAFE_HINT}")
            log.warning("local sandbox WITHOUT isolation (unsafe=True): %s", self.isolation.problem)
        self._prefix = f"sandbox-{id(self)}"
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, self._prefix)

    # ---- public ----------------------------------------------------------------------------

    def run(
        self,
        code: str,
        files: dict[str, str | bytes] | None = None,
        stdin: str = "",
        timeout_s: float | None = None,
    ) -> RunResult:
        """Run `code` as main.py in a fresh scratch folder holding `files`."""
        files = {**(files or {}), "main.py": code}
        for name in files:
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise InvalidRequestError(
                    f"files: expected a relative path inside the scratch folder, got {name!r}"
                )
        run = _Run(self.isolation, self.limits, self.audit)
        return run.run(files, stdin, timeout_s or self.limits.timeout_s)

    def submit(self, code: str, files=None, stdin: str = "", timeout_s=None):
        """`run` on a worker thread; returns a concurrent.futures.Future[RunResult]. Called
        from one of those workers, it runs inline (waiting on the pool there would deadlock)."""
        if threading.current_thread().name.startswith(self._prefix):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self.run(code, files, stdin, timeout_s))
            return done
        return self._pool.submit(self.run, code, files, stdin, timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
