"""Ordinary programs run; bad ones end with the right verdict (with the audit hook, `blocked`
at the first forbidden call). Containment without the hook: test_sandbox_containment.py."""

from __future__ import annotations

import os
import time

import pytest

from treadle.errors import InvalidRequestError
from treadle.sandbox import LocalSandbox, SandboxLimits

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_procs=4, max_output_bytes=4096)


@pytest.fixture(scope="module")
def box():
    with LocalSandbox(LIMITS, workers=2) as sandbox:
        yield sandbox


def test_a_plain_program_runs(box):
    r = box.run(
        "import sys\nprint(sys.stdin.read()[::-1])\nopen('f.txt', 'w').write('x')", stdin="abc"
    )
    assert (r.status, r.stdout, r.exit_code) == ("ok", "cba\n", 0)
    r = box.run("raise ValueError('boom')")
    assert r.status == "error" and "ValueError: boom" in r.stderr
    assert box.run("raise SystemExit(3)").exit_code == 3


def test_files_arrive_in_the_scratch_folder(box):
    files = {"data/in.txt": "hello", "blob.bin": bytes(range(256))}
    code = (
        "import os\nprint(open('data/in.txt').read(), len(open('blob.bin', 'rb').read()))\n"
        "print(sorted(os.listdir('.')))"
    )
    r = box.run(code, files)
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines() == ["hello 256", "['blob.bin', 'data', 'main.py']"]
    with pytest.raises(InvalidRequestError, match="relative path"):
        box.run("pass", {"../escape.txt": "x"})
    with pytest.raises(InvalidRequestError, match="relative path"):
        box.run("pass", {"/etc/x": "x"})


def test_the_standard_library_works_inside(box):
    code = (
        "import json, math, re, collections, itertools, heapq, bisect, functools, fractions\n"
        "import decimal, datetime, random, string, sqlite3, hashlib, io, time\n"
        "print(json.dumps({'pi': round(math.pi, 2)}), sqlite3.connect(':memory:')"
        ".execute('select 1+1').fetchone()[0], open('/dev/urandom', 'rb').read(1) != None)"
    )
    r = box.run(code)
    assert (r.status, r.stdout) == ("ok", '{"pi": 3.14} 2 True\n'), r.stderr


def test_infinite_loop_times_out(box):
    start = time.monotonic()
    r = box.run("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout"
    assert time.monotonic() - start < 3.0


def test_cpu_limit_catches_a_busy_loop_before_the_wall_clock():
    with LocalSandbox(SandboxLimits(timeout_s=30.0, cpu_s=1), workers=1) as sandbox:
        r = sandbox.run("while True:\n    pass")
    assert r.status == "timeout" and r.wall_s < 10


def test_memory_hog(box):
    r = box.run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert r.status == "memory" and "allocated" not in r.stdout


def test_huge_output_is_capped(box):
    r = box.run("while True:\n    print('x' * 1000)")
    assert r.status == "output_limit" and r.truncated
    assert len(r.stdout) <= LIMITS.max_output_bytes


def test_the_hook_blocks_network_files_processes_and_signals(box, tmp_path):
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')"
    r = box.run(code)
    assert r.status == "blocked" and "connected" not in r.stdout
    r = box.run("print(open('/etc/hostname').read())")
    assert r.status == "blocked"
    r = box.run("import os\nprint(os.listdir('/etc'))")
    assert r.status == "blocked"
    r = box.run("import os\nos.symlink('/etc/passwd', 'p')")
    assert r.status == "blocked"
    r = box.run("import os\nwhile True:\n    os.fork()")
    assert r.status == "blocked"
    r = box.run("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])")
    assert r.status == "blocked"
    r = box.run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)")
    assert r.status == "blocked"
    # its own private /tmp is writable
    r = box.run("open('/tmp/x', 'w').write('x')\nprint(open('/tmp/x').read())")
    assert (r.status, r.stdout) == ("ok", "x\n"), r.stderr


def test_parallel_workers_run_at_once():
    with LocalSandbox(SandboxLimits(timeout_s=5), workers=4) as sandbox:
        start = time.monotonic()
        futures = [sandbox.submit("import time\ntime.sleep(0.5)") for _ in range(4)]
        results = [f.result() for f in futures]
        elapsed = time.monotonic() - start
    assert all(r.status == "ok" for r in results)
    assert elapsed < 1.8  # four half-second runs together, not one after another
