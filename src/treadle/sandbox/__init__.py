"""Run untrusted Python solutions against unit tests.

    from treadle.sandbox import LocalSandbox, grade
    with LocalSandbox(workers=4) as box:
        result = box.run("print(input()[::-1])", stdin="abc")      # RunResult
        verdict = grade(box, solution_code, tests)                  # Verdict

Backends: `LocalSandbox` (a bubblewrap box per run, see local.py for what is guaranteed) and
`FusionSandbox` (a SandboxFusion server's `run_code` API).
"""

from treadle.sandbox.fusion import FusionSandbox, serve_run_code
from treadle.sandbox.grading import TestCase, TestResult, Verdict, grade, parse_tests
from treadle.sandbox.local import Isolation, LocalSandbox, SandboxLimits, probe_isolation
from treadle.sandbox.types import STATUSES, RunResult, Sandbox, SandboxUnavailableError

__all__ = [
    "STATUSES",
    "FusionSandbox",
    "Isolation",
    "LocalSandbox",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailableError",
    "TestCase",
    "TestResult",
    "Verdict",
    "grade",
    "parse_tests",
    "probe_isolation",
    "serve_run_code",
]
