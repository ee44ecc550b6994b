"""Grade a solution against unit tests: the expected outputs never enter the sandbox.

The sandbox gets the solution and the test *inputs* only; a harness runs every test, prints
what the solution produced, and the grader (outside) compares it with the expected output. A
solution can therefore not pass by reading or forging the answers.

Test formats (DeepCoder / LiveCodeBench / TACO), all through `parse_tests`:
  - [{"input": "1 2\\n", "output": "3\\n", "testtype": "stdin_stdout"}, ...]
  - [{"input": "[1, 2]\\n3", "output": "[4]", "testtype": "functional",
      "metadata": {"func_name": "f"}}, ...]   (one JSON value per input line)
  - {"inputs": [...], "outputs": [...], "fn_name": "f"}   (TACO / APPS; no fn_name: stdin)
  - [{"type": "function_call", "fn_name": "f", "input": [...], "output": [...]}]
    (PrimeIntellect; "type": "stdin_stdout" for stdin tests)
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from treadle.errors import InvalidRequestError
from treadle.sandbox.types import RunResult, Sandbox


@dataclass
class TestCase:
    input: Any  # stdin text, or the list of arguments of a functional test
    output: Any  # expected stdout text, or the expected return value
    fn_name: str | None = None  # functional test: the function (or Solution method) to call

    __test__ = False  # not a pytest class


@dataclass
class TestResult:
    status: str  # passed | failed | error | timeout | not_run
    got: str = ""
    error: str = ""

    __test__ = False


@dataclass
class Verdict:
    passed: bool
    n_passed: int
    n_tests: int
    run: RunResult
    results: list[TestResult] = field(default_factory=list)

    @property
    def pass_rate(self) -> float:
        return self.n_passed / self.n_tests if self.n_tests else 0.0


# ---- test formats ------------------------------------------------------------------------


def parse_tests(raw: Any, fn_name: str | None = None) -> list[TestCase]:
    """Tests in any of the formats above (or a JSON string of one) → TestCases."""
    if isinstance(raw, str):
        raw = json.loads(raw)
    if isinstance(raw, dict) and "inputs" in raw and "outputs" in raw:
        return _taco_tests(raw, fn_name or raw.get("fn_name"))
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise InvalidRequestError(
            f"tests: expected a list or a dict of inputs/outputs, got {raw!r:.80}"
        )
    cases = []
    for test in raw:
        if isinstance(test, TestCase):
            cases.append(test)
            continue
        meta = test.get("metadata") or {}
        meta = json.loads(meta) if isinstance(meta, str) else meta
        name = meta.get("func_name") or test.get("fn_name") or fn_name
        kind = test.get("testtype") or test.get("type")
        if kind in ("functional", "function_call") or (name and kind is None):
            if not name:
                raise InvalidRequestError(
                    f"tests: a functional test needs func_name, got {test!r:.80}"
                )
            out = _value(test["output"])
            if kind == "function_call" and isinstance(out, list) and len(out) == 1:
                out = out[0]  # PrimeIntellect rows wrap the return value, as TACO does
            cases.append(TestCase(_args(test["input"]), out, name))
        else:
            cases.append(TestCase(str(test["input"]), str(test["output"])))
    return cases


def _taco_tests(raw: dict, fn_name: str | None) -> list[TestCase]:
    cases = []
    for inp, out in zip(raw["inputs"], raw["outputs"], strict=False):
        if fn_name:
            # TACO wraps each expected return value in a list
            out = out[0] if isinstance(out, list) and len(out) == 1 else out
            cases.append(TestCase(inp if isinstance(inp, list) else _args(inp), out, fn_name))
        else:
            text = lambda v: "\n".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
            cases.append(TestCase(text(inp), text(out)))
    return cases


def _args(inp: Any) -> list:
    if isinstance(inp, list):
        return inp
    return [json.loads(line) for line in str(inp).splitlines() if line.strip()]


def _value(out: Any) -> Any:
    if isinstance(out, str):
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            return out
    return out


# ---- the harness that runs inside the sandbox ----------------------------------------------

HARNESS = r"""
import io, json, os, signal, sys, traceback
cfg = json.load(open("tests.json"))
marker, fn_name, per_test = cfg["marker"], cfg["fn_name"], cfg["timeout_s"]
real_stdout = sys.stdout
code = compile(open("solution.py").read(), "solution.py", "exec")

class TestTimeout(BaseException):
    pass

def on_alarm(*_):
    raise TestTimeout()

signal.signal(signal.SIGALRM, on_alarm)

def report(i, status, got="", error=""):
    real_stdout.write(marker + json.dumps({"i": i, "status": status, "got": got[:4000], "error": error[-2000:]}) + "\n")
    real_stdout.flush()

def run(i, fn):
    signal.setitimer(signal.ITIMER_REAL, per_test)
    try:
        got = fn()
        signal.setitimer(signal.ITIMER_REAL, 0)
        report(i, "ran", got)
    except TestTimeout:
        report(i, "timeout")
    except MemoryError:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report(i, "error", error="MemoryError")
    except BaseException:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report(i, "error", error=traceback.format_exc())

if fn_name is None:
    for i, text in enumerate(cfg["inputs"]):
        with open("stdin.txt", "w") as f:
            f.write(text)
        fd = os.open("stdin.txt", os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        sys.stdin = open(0, "r", closefd=False)
        def one():
            out = io.TextIOWrapper(io.BytesIO(), write_through=True)
            sys.stdout = out
            try:
                exec(code, {"__name__": "__main__"})
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            finally:
                sys.stdout = real_stdout
            out.flush()
            return out.buffer.getvalue().decode(errors="replace")
        run(i, one)
else:
    scope = {"__name__": "solution"}
    exec(code, scope)
    target = scope.get(fn_name)
    if target is None and "Solution" in scope:
        target = getattr(scope["Solution"](), fn_name, None)
    for i, args in enumerate(cfg["inputs"]):
        if target is None:
            report(i, "error", error="no function named " + fn_name)
            continue
        def one():
            sys.stdout = io.StringIO()
            try:
                value = target(*args)
            finally:
                sys.stdout = real_stdout
            return json.dumps(value, default=repr)
        run(i, one)
"""


def grade(
    sandbox: Sandbox,
    code: str,
    tests: list[TestCase],
    timeout_per_test_s: float = 2.0,
    overhead_s: float = 2.0,
) -> Verdict:
    """Run `code` on every test (one sandbox run) and compare outputs here, outside."""
    if not tests:
        raise InvalidRequestError("tests: expected at least one test, got none")
    fn_names = {t.fn_name for t in tests}
    if len(fn_names) > 1:
        raise InvalidRequestError(f"tests: expected one fn_name for all tests, got {fn_names}")
    marker = f"@@treadle-{secrets.token_hex(8)}@@"
    spec = {
        "marker": marker,
        "fn_name": tests[0].fn_name,
        "timeout_s": timeout_per_test_s,
        "inputs": [t.input for t in tests],
    }
    files = {"solution.py": code, "tests.json": json.dumps(spec)}
    timeout = overhead_s + timeout_per_test_s * len(tests)
    run = sandbox.submit(HARNESS, files, "", timeout).result()
    reported: dict[int, dict] = {}
    for line in run.stdout.splitlines():
        if line.startswith(marker):
            try:
                rec = json.loads(line[len(marker) :])
                reported.setdefault(int(rec["i"]), rec)
            except (ValueError, KeyError, TypeError):
                continue
    results = []
    for i, test in enumerate(tests):
        rec = reported.get(i)
        if rec is None:
            status = "timeout" if run.status == "timeout" else "not_run"
            results.append(TestResult(status, error=run.status))
        elif rec["status"] == "ran":
            same = _same_output(rec["got"], test)
            results.append(TestResult("passed" if same else "failed", rec["got"]))
        else:
            results.append(TestResult(rec["status"], rec.get("got", ""), rec.get("error", "")))
    n_passed = sum(r.status == "passed" for r in results)
    return Verdict(n_passed == len(tests), n_passed, len(tests), run, results)


def _same_output(got: str, test: TestCase) -> bool:
    if test.fn_name is not None:
        try:
            value = json.loads(got)
        except json.JSONDecodeError:
            return False
        return _same_value(value, json.loads(json.dumps(test.output)))
    return _same_text(got, str(test.output))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _same_text(got: str, expected: str) -> bool:
    """Same lines up to trailing whitespace; numbers equal up to 1e-6 when not textually."""
    lines_got = [line.rstrip() for line in got.strip().splitlines()]
    lines_exp = [line.rstrip() for line in expected.strip().splitlines()]
    if lines_got == lines_exp:
        return True
    tokens_got, tokens_exp = got.split(), expected.split()
    if len(tokens_got) != len(tokens_exp):
        return False
    for a, b in zip(tokens_got, tokens_exp, strict=True):
        if a == b:
            continue
        try:
            if not math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9):
                return False
        except ValueError:
            return False
    return True


def feedback(verdict: Verdict, tests: list[TestCase], max_chars: int = 600) -> str:
    """Test results as text for the model (what `check_solution` returns)."""
    lines = [f"{verdict.n_passed}/{verdict.n_tests} tests passed."]
    for test, res in zip(tests, verdict.results, strict=True):
        if res.status == "passed":
            continue
        line = f"input {json.dumps(test.input)[:80]}: {res.status}"
        if res.status == "failed":
            line += f", expected {json.dumps(test.output)[:60]}, got {res.got.strip()[:60]!r}"
        elif res.error:
            line += f": {res.error.strip().splitlines()[-1][:120]}"
        lines.append(line)
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
