"""Grading against hand-checked verdicts, in every test format; and the SandboxFusion API
round trip (client → our run_code server → local sandbox)."""

from __future__ import annotations

import pytest

from treadle.sandbox import FusionSandbox, LocalSandbox, SandboxLimits, grade, parse_tests
from treadle.sandbox.grading import feedback

STDIN_TESTS = [
    {"input": "1 2\n", "output": "3\n", "testtype": "stdin_stdout"},
    {"input": "5 5\n", "output": "10\n", "testtype": "stdin_stdout"},
]


@pytest.fixture(scope="module")
def box():
    with LocalSandbox(SandboxLimits(timeout_s=5), workers=2) as sandbox:
        yield sandbox


def test_stdin_tests_right_wrong_and_crashing(box):
    tests = parse_tests(STDIN_TESTS)
    v = grade(box, "a, b = map(int, input().split())\nprint(a + b)", tests)
    assert (v.passed, v.n_passed, v.pass_rate) == (True, 2, 1.0)
    v = grade(
        box, "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a * b)", tests
    )
    assert (v.passed, [r.status for r in v.results]) == (False, ["failed", "failed"])
    assert "expected" in feedback(v, tests)
    v = grade(box, "a, b = map(int, input().split())\nprint(a // (a - 1))", tests)
    assert [r.status for r in v.results] == ["error", "failed"]


def test_functional_lcb_and_taco_formats(box):
    lcb = [
        {
            "input": "[1, 2]\n3",
            "output": "[4, 5]",
            "testtype": "functional",
            "metadata": {"func_name": "shift"},
        },
    ]
    code = "class Solution:\n    def shift(self, xs, k):\n        return [x + k for x in xs]"
    assert grade(box, code, parse_tests(lcb)).passed
    taco = {"inputs": [[2, 3], [0, 1]], "outputs": [[5], [1]], "fn_name": "add"}
    assert grade(box, "def add(a, b):\n    return a + b", parse_tests(taco)).passed
    assert not grade(box, "def add(a, b):\n    return a - b", parse_tests(taco)).passed
    prime = [{"type": "function_call", "fn_name": "add", "input": [2, 3], "output": [5]}]
    assert grade(box, "def add(a, b):\n    return a + b", parse_tests(prime)).passed


def test_a_slow_test_times_out_but_others_are_graded(box):
    tests = parse_tests([{"input": "0\n", "output": "0\n"}, {"input": "1\n", "output": "1\n"}])
    code = "n = int(input())\nwhile n == 0:\n    pass\nprint(n)"
    v = grade(box, code, tests, timeout_per_test_s=0.5)
    assert [r.status for r in v.results] == ["timeout", "passed"]


def test_forged_exit_does_not_pass(box):
    # exiting early (or printing a made-up result line) cannot pass without the answers
    tests = parse_tests(STDIN_TESTS)
    assert not grade(box, "import os\nos._exit(0)", tests).passed
    assert not grade(box, "print('3')\nprint('10')", tests).passed


def test_fusion_client_against_run_code_server(box):
    from treadle.sandbox import serve_run_code

    server, url = serve_run_code(box)
    remote = FusionSandbox(url, workers=2)
    try:
        r = remote.run("print(input() * 2)", stdin="ab")
        assert (r.status, r.stdout) == ("ok", "abab\n")
        assert remote.run("raise SystemExit(3)").exit_code == 3
        assert remote.run("while True:\n    pass", timeout_s=0.5).status == "timeout"
        tests = parse_tests(STDIN_TESTS)
        assert grade(remote, "a, b = map(int, input().split())\nprint(a + b)", tests).passed
    finally:
        remote.close()
        server.shutdown()


def test_fusion_unreachable_is_a_sandbox_error():
    remote = FusionSandbox("http://127.0.0.1:9", http_timeout_s=2)
    try:
        assert remote.run("print(1)").status == "sandbox_error"
    finally:
        remote.close()
