"""Each bad program is contained with the right verdict, by the Python-level guard and, where
the machine allows it, by the kernel layers alone (audit hook off)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from treadle.sandbox import LocalSandbox, SandboxLimits, probe_isolation

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_procs=4, max_output_bytes=4096)
ISO = probe_isolation()
KERNEL = pytest.mark.skipif(
    not (ISO.unshare and (ISO.drop_uid or os.geteuid() != 0)),
    reason="needs namespaces and an unprivileged uid (unshare; setpriv as root)",
)


@pytest.fixture(scope="module")
def box():
    with LocalSandbox(LIMITS, workers=2) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def bare():
    """Only the kernel layers: no audit hook."""
    with LocalSandbox(LIMITS, workers=2, audit=False) as sandbox:
        yield sandbox


def _sessions_alive(session: int) -> list[int]:
    alive = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session and fields[0] != "Z":  # zombies hold nothing
                    alive.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return alive


def test_a_plain_program_runs(box):
    r = box.run(
        "import sys\nprint(sys.stdin.read()[::-1])\nopen('f.txt', 'w').write('x')", stdin="abc"
    )
    assert (r.status, r.stdout, r.exit_code) == ("ok", "cba\n", 0)
    r = box.run("raise ValueError('boom')")
    assert r.status == "error" and "ValueError: boom" in r.stderr


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


def test_network_is_blocked(box):
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')"
    r = box.run(code)
    assert r.status == "blocked" and "connected" not in r.stdout


@KERNEL
def test_network_namespace_alone_has_no_route(bare):
    code = (
        "import socket\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('connected')\n"
        "except OSError as e:\n    print('refused', e.errno)"
    )
    r = bare.run(code)
    assert r.status == "ok" and r.stdout.startswith("refused")


def test_files_outside_scratch_are_blocked(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hidden")
    secret.chmod(0o644)
    r = box.run(f"print(open({str(secret)!r}).read())")
    assert r.status == "blocked" and "hidden" not in r.stdout
    target = tmp_path / "written.txt"
    r = box.run(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "blocked" and not target.exists()
    r = box.run("import os\nprint(os.listdir('/etc'))")
    assert r.status == "blocked"
    r = box.run("import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())")
    assert r.status == "blocked"


@KERNEL
def test_kernel_alone_stops_writes_outside_scratch(bare, tmp_path):
    target = tmp_path / "written.txt"
    tmp_path.chmod(0o755)
    r = bare.run(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "error" and "Permission" in r.stderr and not target.exists()


def test_fork_bomb_is_blocked(box):
    r = box.run("import os\nwhile True:\n    os.fork()")
    assert r.status == "blocked"
    r = box.run("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])")
    assert r.status == "blocked"


@KERNEL
def test_fork_bomb_is_contained_by_the_kernel(bare):
    # RLIMIT_NPROC (a few processes), the wall clock, then the whole pid namespace is killed
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    r = bare.run(code, timeout_s=1.5)
    assert r.status == "timeout" and time.monotonic() - start < 5
    deadline = time.monotonic() + 3
    while r.pid and _sessions_alive(r.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel kills the namespace's processes asynchronously
    assert r.pid and not _sessions_alive(r.pid)


def test_killing_its_parent_is_blocked(box):
    me = os.getpid()
    r = box.run(f"import os, signal\nos.kill({me}, signal.SIGTERM)\nos.kill(os.getppid(), 9)")
    assert r.status == "blocked"
    assert os.getpid() == me  # still here


@KERNEL
def test_kernel_alone_keeps_its_parent_alive(bare):
    me = os.getpid()
    code = (
        f"import os\nfor pid in (os.getppid(), {me}):\n"
        "    try:\n        os.kill(pid, 9)\n        print('killed', pid)\n"
        "    except OSError as e:\n        print('denied', pid, e.errno)"
    )
    r = bare.run(code)
    assert f"denied {me}" in r.stdout and f"killed {me}" not in r.stdout


def test_parallel_workers_run_at_once():
    with LocalSandbox(SandboxLimits(timeout_s=5), workers=4) as sandbox:
        start = time.monotonic()
        futures = [sandbox.submit("import time\ntime.sleep(0.5)") for _ in range(4)]
        results = [f.result() for f in futures]
        elapsed = time.monotonic() - start
    assert all(r.status == "ok" for r in results)
    assert elapsed < 1.8  # four half-second runs together, not one after another
