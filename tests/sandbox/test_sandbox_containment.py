"""Abuse cases, each asserted contained by the box, the cgroup and the limits alone: the audit
hook is off (`bare`), or switched off from inside the run. A probe holding one valid key tried
each of these against the previous sandbox, and each got through."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import tempfile
import time
from importlib import resources
from pathlib import Path

import pytest

from treadle.cookbook.code_env import builtin_problems
from treadle.sandbox import LocalSandbox, SandboxLimits, grade, probe_isolation

LIMITS = SandboxLimits(
    timeout_s=4.0, cpu_s=3, memory_mb=256, max_procs=4, max_output_bytes=1 << 16, scratch_mb=32
)
ISO = probe_isolation()
CGROUP_MEMORY = pytest.mark.skipif(
    not (ISO.cgroups and ISO.cgroups.memory), reason="no writable memory cgroup here"
)
SECRET = "tr34dle-s3cret-" + os.urandom(6).hex()
PROBLEMS_FILE = str(resources.files("treadle.cookbook.data").joinpath("code_problems.jsonl"))


@pytest.fixture(scope="module")
def bare():
    """The box with no audit hook: only the kernel-enforced layers."""
    with LocalSandbox(LIMITS, workers=2, audit=False) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def box():
    with LocalSandbox(LIMITS, workers=2) as sandbox:
        yield sandbox


@pytest.fixture
def root_only_dir():
    """A 0700 folder owned by the server's user, holding a 0600 secret."""
    folder = Path(tempfile.mkdtemp(prefix="treadle-private-"))
    secret = folder / "secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    folder.chmod(0o700)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _try_read(paths: list[str]) -> str:
    """Code that prints what it could read of `paths` (or why not), one line each."""
    return (
        "import sys\n"
        f"for p in {paths!r}:\n"
        "    try:\n"
        "        print('READ', p, open(p, 'rb').read(4096))\n"
        "    except OSError as e:\n"
        "        print('DENIED', p, type(e).__name__)\n"
    )


def _proc_pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _alive_in_namespace(ns: str) -> list[int]:
    return [
        int(e.name)
        for e in os.scandir("/proc")
        if e.name.isdigit() and _proc_pid_ns(int(e.name)) == ns
    ]


def test_system_files_are_not_there(bare):
    r = bare.run(_try_read(["/etc/shadow", "/etc/passwd", "/etc/hostname", "/root/.bashrc"]))
    assert r.status == "ok", r.stderr
    assert "READ" not in r.stdout and r.stdout.count("DENIED") == 4
    if os.path.exists("/etc/shadow"):
        assert open("/etc/shadow").read(20)[:5] not in r.stdout.replace("DENIED", "")


def test_a_0600_file_in_a_0700_folder_is_unreadable(bare, root_only_dir):
    secret = str(root_only_dir / "secret.txt")
    code = _try_read([secret]) + f"import os\nprint(os.path.exists({str(root_only_dir)!r}))"
    r = bare.run(code)
    assert r.status == "ok" and SECRET not in r.stdout
    assert r.stdout.splitlines()[-1] == "False"  # not even its folder exists in there


def test_a_database_outside_is_unreadable_with_plain_sqlite3(bare, root_only_dir):
    db = root_only_dir / "treadle.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table api_keys (tenant text, key_hash text)")
        conn.execute("insert into api_keys values ('acme', ?)", (SECRET,))
    db.chmod(0o600)
    code = (
        "import sqlite3\n"
        "try:\n"
        f"    c = sqlite3.connect('file:{db}?mode=ro', uri=True)\n"
        "    print(c.execute('select * from api_keys').fetchall())\n"
        "except sqlite3.Error as e:\n"
        "    print('DENIED', e)\n"
    )
    r = bare.run(code)
    assert r.status == "ok" and SECRET not in r.stdout and "DENIED" in r.stdout


def test_no_package_no_problem_file_no_installed_site_packages(bare):
    code = (
        "import os, sys\n"
        "hits = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root in ('/proc', '/dev'):\n"
        "        dirs[:] = []\n"
        "        continue\n"
        "    hits += [os.path.join(root, f) for f in files if f.endswith('.jsonl')]\n"
        "    hits += [os.path.join(root, d) for d in dirs if d == 'treadle']\n"
        "print('HITS', hits)\n"
        "try:\n    import treadle\n    print('IMPORTED')\nexcept ImportError:\n    print('NO TREADLE')\n"
        f"print(os.path.exists({PROBLEMS_FILE!r}))\n"
    )
    # the walk stats every file the box shows (130k here): 0.4 s with the inode cache warm,
    # 3 s cold, and over 15 s once at the end of a full test run
    r = bare.run(code, timeout_s=120.0)
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines() == ["HITS []", "NO TREADLE", "False"]
    # every site-packages folder of the interpreter is there, but empty
    import site

    folders = [p for p in site.getsitepackages() if os.path.isdir(p)]
    r = bare.run(f"import os\nfor p in {folders!r}:\n    print(os.path.isdir(p) and os.listdir(p))")
    assert all(line in ("[]", "False") for line in r.stdout.splitlines()), r.stdout


CHEAT = """
import json, os

def _paths():
    yield {problems!r}  # where the grader's package keeps it
    for root, dirs, files in os.walk('/'):
        if root in ('/proc', '/dev', '/sys'):
            dirs[:] = []
            continue
        yield from (os.path.join(root, f) for f in files if f == 'code_problems.jsonl')

def _answers():
    for path in _paths():
        try:
            rows = [json.loads(line) for line in open(path)]
        except OSError:
            continue
        return {{t['input']: t['output'] for r in rows if r['name'] == 'add' for t in r['tests']}}
    return {{}}

ANSWERS = _answers()

def add(a, b):
    return json.loads(ANSWERS.get(f"{{a}}\\n{{b}}", "null"))
"""


@pytest.mark.parametrize("hook", [False, True])
def test_grade_cannot_be_passed_by_reading_the_expected_outputs(bare, box, hook):
    problem = builtin_problems()[0]
    assert problem.name == "add" and len(problem.tests) == 4
    sandbox = box if hook else bare
    verdict = grade(sandbox, CHEAT.format(problems=PROBLEMS_FILE), problem.tests, 2.0, 10.0)
    assert not verdict.passed and verdict.n_passed == 0, verdict


def test_host_unix_sockets_are_unreachable(bare, tmp_path):
    path = str(tmp_path / "server.sock")
    abstract = "\0treadle-test-" + os.urandom(4).hex()
    servers = []
    for address in (path, abstract):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(4)
        s.settimeout(0.2)
        servers.append(s)
    os.chmod(path, 0o777)
    os.chmod(tmp_path, 0o755)
    code = (
        "import socket\n"
        f"for a in ({path!r}, {abstract!r}):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n        s.connect(a)\n        print('CONNECTED')\n"
        "    except OSError as e:\n        print('REFUSED', type(e).__name__)\n"
    )
    try:
        r = bare.run(code)
        assert r.status == "ok" and r.stdout.count("REFUSED") == 2, r.stdout + r.stderr
        for s in servers:
            with pytest.raises(TimeoutError):
                s.accept()
    finally:
        for s in servers:
            s.close()


def test_tcp_to_the_servers_own_port_fails(bare):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"for host in ('127.0.0.1', 'localhost', '1.1.1.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=1)\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n        print('FAILED', host, type(e).__name__)\n"
    )
    try:
        r = bare.run(code)
        assert r.status == "ok" and r.stdout.count("FAILED") == 3, r.stdout + r.stderr
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_host_processes_are_invisible(bare):
    me = os.getpid()
    code = (
        "import os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "lines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
        "print(len(pids), any(b'pytest' in l for l in lines), os.getpid())\n"
        f"print(os.path.exists('/proc/{me}/cmdline') and b'pytest' in open('/proc/{me}/cmdline', 'rb').read())\n"
    )
    r = bare.run(code)
    assert r.status == "ok", r.stderr
    count, saw_pytest, _ = r.stdout.split()[:3]
    assert int(count) <= 3 and saw_pytest == "False"  # bubblewrap's init and the run itself
    assert r.stdout.splitlines()[1] == "False"


def test_host_environment_is_not_visible(bare, monkeypatch):
    monkeypatch.setenv("TREADLE_TEST_SECRET", SECRET)
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try:\n            print(open(f'/proc/{p}/environ', 'rb').read())\n"
        "        except OSError:\n            pass\n"
    )
    r = bare.run(code)
    assert r.status == "ok" and SECRET not in r.stdout, r.stdout


def test_no_capabilities_no_root_no_new_privileges(bare):
    code = (
        "import os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "print(status['CapEff'].strip(), status['CapPrm'].strip(), status['CapAmb'].strip(), status['NoNewPrivs'].strip())\n"
        "print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
    )
    r = bare.run(code)
    assert r.status == "ok", r.stderr
    caps, ids = r.stdout.splitlines()
    assert caps.split() == ["0000000000000000"] * 3 + ["1"]
    uid, euid, gid, groups = ids.split(" ", 3)
    assert uid == euid and int(uid) != 0 and int(gid) != 0
    if os.geteuid() == 0:  # each run its own uid: nothing of anybody's is writable to it
        assert int(uid) >= 100_000 and groups == "[]"


def test_no_nested_user_namespace(bare):
    code = (
        "import ctypes, os, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "r = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'], capture_output=True)\n"
        "print(r.returncode != 0, r.stdout)\n"
    )
    r = bare.run(code)
    assert r.status == "ok", r.stderr
    first, second = r.stdout.splitlines()
    assert first.split()[0] == "-1" and second.startswith("True")


def test_tmp_and_shm_are_private_and_gone_after(bare):
    name = "treadle-leak-" + os.urandom(4).hex()
    code = (
        f"for p in ('/tmp/{name}', '/dev/shm/{name}', '{name}'):\n"
        "    open(p, 'w').write('x')\n"
        "print('WROTE')\n"
    )
    r = bare.run(code)
    assert (r.status, r.stdout) == ("ok", "WROTE\n"), r.stderr
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/dev/shm/{name}")
    r = bare.run(_try_read([f"/tmp/{name}", f"/dev/shm/{name}", name]))
    assert r.stdout.count("DENIED") == 3


def test_a_concurrent_run_cannot_see_the_others_scratch(bare):
    writer = (
        "import os, time\n"
        f"open('secret.txt', 'w').write({SECRET!r})\n"
        f"open('/tmp/secret.txt', 'w').write({SECRET!r})\n"
        "print(os.getcwd(), flush=True)\n"
        "time.sleep(2)\n"
    )
    reader = (
        "import glob, os, time\n"
        "seen = []\n"
        "for _ in range(10):\n"
        "    for pattern in ('/sandbox/*', '/tmp/*', '/tmp/*/*', '/proc/*/cwd/*', '/proc/*/root/tmp/*'):\n"
        "        for p in glob.glob(pattern):\n"
        "            try:\n                seen.append(open(p).read(200))\n"
        "            except OSError:\n                pass\n"
        "    time.sleep(0.1)\n"
        "print(seen)\n"
    )
    first = bare.submit(writer)
    time.sleep(0.5)
    second = bare.submit(reader)
    a, b = first.result(), second.result()
    assert a.status == "ok" and b.status == "ok", a.stderr + b.stderr
    assert SECRET not in b.stdout


@CGROUP_MEMORY
def test_five_processes_of_900_mb_cannot_hold_memory_at_once():
    limits = SandboxLimits(timeout_s=20.0, cpu_s=10, memory_mb=1024, max_procs=8)
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "kids = []\n"
        "for i in range(5):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (900 << 20)\n"  # touched: every page is really used
        "        os.write(w, b'%d\\n' % os.getpid())\n"  # holding it now
        "        time.sleep(8)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "time.sleep(5)\n"
        "os.set_blocking(r, False)\n"
        "held = {int(p) for p in os.read(r, 4096).split()}\n"
        "holding = [p for p in kids if p in held and os.waitpid(p, os.WNOHANG) == (0, 0)]\n"
        "print('HELD', len(held), 'HOLDING', len(holding), flush=True)\n"
    )
    with LocalSandbox(limits, workers=1, audit=False) as sandbox:
        r = sandbox.run(code)
    assert r.status == "memory", (r.status, r.stdout, r.stderr)
    held, holding = (int(n) for n in r.stdout.split()[1::2])
    assert held >= 1 and holding <= 1  # never two holding 900 MB at once, let alone five


def test_a_big_write_fills_only_the_capped_scratch(bare):
    before = shutil.disk_usage(tempfile.gettempdir()).used
    code = (
        "import os, time\n"
        "chunk, written, errors, start = b'x' * (1 << 20), 0, set(), time.monotonic()\n"
        "for i in range(1536):\n"  # 1.5 GB, in files of 16 MB, spread over every writable place
        "    folder = ('.', '/tmp', '/dev/shm')[i % 48 // 16]\n"
        "    try:\n"
        "        with open(f'{folder}/f{i // 16}', 'ab') as f:\n"
        "            f.write(chunk)\n"
        "        written += len(chunk)\n"
        "    except OSError as e:\n"
        "        errors.add(e.errno)\n"
        "print(written >> 20, sorted(errors), round(time.monotonic() - start, 1))\n"
    )
    r = bare.run(code, timeout_s=10.0)
    assert r.status == "ok", r.stderr
    written_mb = int(r.stdout.split()[0])
    assert written_mb <= 3 * LIMITS.scratch_mb  # scratch, /tmp, /dev/shm: each a capped tmpfs
    assert "28" in r.stdout or "27" in r.stdout  # ENOSPC (tmpfs full) or EFBIG (RLIMIT_FSIZE)
    assert shutil.disk_usage(tempfile.gettempdir()).used - before < 512 << 20


def test_switching_the_audit_hook_off_from_inside_changes_nothing(box):
    code = (
        "import gc, types\n"
        "for f in gc.get_objects():\n"
        "    if isinstance(f, types.FunctionType) and f.__closure__:\n"
        "        for cell in f.__closure__:\n"
        "            try:\n                v = cell.cell_contents\n            except ValueError:\n                continue\n"
        "            if isinstance(v, list) and v == [False]:\n                v[0] = True\n"
        "import os, subprocess\n"
        "print('HOOK OFF', len(os.listdir('/proc')) > 0, flush=True)\n"  # listing /proc: blocked with the hook
        "r = subprocess.run(['cat', '/etc/shadow', '/etc/passwd'], capture_output=True)\n"
        "print('CAT', r.returncode, r.stdout[:200])\n"
        "kids, failed = [], 0\n"
        "for _ in range(20):\n"
        "    try:\n        kids.append(subprocess.Popen(['sleep', '3']))\n"
        "    except OSError:\n        failed += 1\n"
        "print('STARTED', len(kids), 'FAILED', failed, flush=True)\n"
    )
    r = box.run(code, timeout_s=5.0)
    assert "HOOK OFF True" in r.stdout, (r.status, r.stdout, r.stderr)  # the bypass worked
    cat = next(line for line in r.stdout.splitlines() if line.startswith("CAT"))
    assert cat.startswith("CAT 1 b''"), cat  # neither file exists in there
    started = next(line for line in r.stdout.splitlines() if line.startswith("STARTED"))
    assert int(started.split()[1]) <= LIMITS.max_procs and int(started.split()[3]) > 0


def test_a_fork_bomb_is_bounded_and_leaves_nothing_behind(bare):
    code = (
        "import os\n"
        "print(os.readlink('/proc/self/ns/pid'), flush=True)\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n        os.fork()\n        n += 1\n"
        "    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    r = bare.run(code, timeout_s=1.5)
    assert r.status == "timeout" and time.monotonic() - start < 5
    ns = r.stdout.split()[0]
    assert ns.startswith("pid:[")
    deadline = time.monotonic() + 3
    while _alive_in_namespace(ns) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel ends the namespace's processes asynchronously
    assert not _alive_in_namespace(ns)


def test_memory_bomb_and_infinite_loop_and_huge_output(bare):
    r = bare.run("x = []\nwhile True:\n    x.append(b'y' * (1 << 20))")
    assert r.status == "memory"
    r = bare.run("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 3
    r = bare.run("import sys\nwhile True:\n    sys.stdout.write('z' * 65536)")
    assert r.status == "output_limit" and len(r.stdout) <= LIMITS.max_output_bytes


def test_writes_outside_and_signals_to_the_host_fail(bare, tmp_path):
    target = tmp_path / "written.txt"
    tmp_path.chmod(0o777)
    me = os.getpid()
    code = (
        "import os\n"
        "try:\n"
        f"    open({str(target)!r}, 'w').write('x')\n    print('WROTE')\n"
        "except OSError as e:\n    print('DENIED', type(e).__name__)\n"
        f"for pid in (1, {me}):\n"
        "    try:\n        os.kill(pid, 9)\n        print('KILLED', pid)\n"
        "    except OSError as e:\n        print('DENIED', type(e).__name__)\n"
    )
    r = bare.run(code)
    assert r.status == "ok" and "WROTE" not in r.stdout and "KILLED" not in r.stdout, r.stdout
    assert not target.exists() and os.getpid() == me


def test_stdin_and_payload_cannot_be_written_back(bare):
    code = (
        "import os\n"
        "for fd in range(0, 20):\n"
        "    try:\n        os.write(fd, b'overwrite')\n        print('WROTE', fd)\n"
        "    except OSError:\n        pass\n"
        "try:\n"  # reopened read-write through /proc
        "    os.write(os.open('/proc/self/fd/0', os.O_RDWR), b'x' * 100000)\n    print('WROTE 0')\n"
        "except OSError as e:\n    print('DENIED', type(e).__name__)\n"
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
    )
    r = bare.run(code, stdin="input")
    wrote = {int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("WROTE")}
    assert wrote <= {1, 2}, r.stdout  # only its own stdout and stderr
    assert r.stdout.splitlines()[-1] == "[0, 1, 2, 3]"  # 3: the listing itself; no payload


def test_many_runs_leave_no_cgroup_behind(bare):
    if not ISO.cgroups:
        pytest.skip("no cgroups here")
    futures = [bare.submit("print(1)") for _ in range(4)]
    assert all(f.result().ok for f in futures)
    for folder in {ISO.cgroups.memory, ISO.cgroups.pids} - {None}:
        left = [p for p in folder.iterdir() if p.name.startswith(f"treadle-sandbox-{os.getpid()}-")]
        assert not left
