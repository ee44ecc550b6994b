"""What a sandbox run returns, whichever backend ran it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from treadle.errors import TreadleError

# ok: exit code 0 · error: non-zero exit or a crash · timeout: wall clock or CPU time ·
# memory: the memory limit (a process, or the run's cgroup) · output_limit: more output than
# allowed · blocked: a forbidden operation the audit hook stopped (file outside the scratch
# folder, network, new process, signal) · killed: killed by the system · sandbox_error: the
# sandbox itself failed (e.g. a remote one is unreachable)
STATUSES = (
    "ok",
    "error",
    "timeout",
    "memory",
    "output_limit",
    "blocked",
    "killed",
    "sandbox_error",
)


class SandboxUnavailableError(TreadleError, RuntimeError):
    """The local sandbox cannot isolate runs on this machine; the message says how to fix it."""


@dataclass
class RunResult:
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    pid: int | None = None  # the local run's process (and session) id

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox(Protocol):
    """A backend: the local process sandbox or a SandboxFusion server."""

    def run(
        self,
        code: str,
        files: dict[str, str | bytes] | None = None,
        stdin: str = "",
        timeout_s: float | None = None,
    ) -> RunResult: ...

    def submit(self, code: str, files=None, stdin: str = "", timeout_s=None): ...

    def close(self) -> None: ...
