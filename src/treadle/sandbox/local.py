"""Run untrusted Python in a separate, limited process: the local sandbox.

Layers, outermost first (each one is checked once when the sandbox starts, and used when the
machine allows it):
  1. a new process session, killed as a whole on the wall-clock timeout;
  2. `unshare --net --pid`: a network namespace with no interface but a downed loopback, and a
     pid namespace (the code can neither see nor signal a process outside it; when its first
     process ends, every process it started dies with it);
  3. a fresh unprivileged uid when the sandbox runs as root (nothing of anybody else's can be
     written or signalled; RLIMIT_NPROC counts only the sandbox's own processes);
  4. rlimits: address space (memory), CPU seconds, processes, file size, open files;
  5. a Python audit hook: opening files outside the scratch folder (writes) or outside it and
     the Python installation (reads), sockets other than AF_UNIX, new processes, signals and
     symlinks end the run with the verdict `blocked`. This layer guards the standard library
     only (ctypes gets past it): the kernel layers above are the boundary.
Output is read through pipes and capped; the run is killed when it writes more.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from treadle.errors import InvalidRequestError
from treadle.sandbox import _runner
from treadle.sandbox.types import RunResult

RUNNER = Path(_runner.__file__)
_KILL_SIGNALS = {signal.SIGXCPU: "timeout", signal.SIGKILL: "killed"}


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole run
    cpu_s: int = 10
    memory_mb: int = 1024  # address space
    max_procs: int = 4  # processes and threads beyond the sandbox's own
    max_output_bytes: int = 1 << 20  # stdout and stderr each
    max_file_mb: int = 16
    env: dict[str, str] = field(
        default_factory=lambda: {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    )


@dataclass(frozen=True)
class Isolation:
    """What this machine allows; found once by `probe_isolation`."""

    unshare: list[str]  # the command prefix ([] when namespaces are unavailable)
    drop_uid: bool  # running as root: each run gets its own unprivileged uid (via setpriv)
    # Capabilities the unprivileged uid keeps: only CAP_DAC_READ_SEARCH, and only when the
    # Python installation is not readable by other users (e.g. it lives under /root).
    keep_caps: tuple[str, ...] = ()

    def uid_prefix(self, uid: int | None) -> list[str]:
        if uid is None or not self.drop_uid:
            return []
        caps = [f"--inh-caps=+{c}" for c in self.keep_caps]
        caps += [f"--ambient-caps=+{c}" for c in self.keep_caps]
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *caps]

    @property
    def network_namespace(self) -> bool:
        return bool(self.unshare)


_probe_lock = threading.Lock()
_probed: Isolation | None = None


def probe_isolation() -> Isolation:
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def _probe() -> Isolation:
    root = os.geteuid() == 0
    unshare = _probe_unshare(root)
    if not (root and shutil.which("setpriv")):
        return Isolation(unshare, False)
    for caps in ((), ("dac_read_search",)):
        iso = Isolation(unshare, True, caps)
        # the interpreter must find its own standard library under the new uid
        stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
        check = f"import os, json; assert os.path.realpath(json.__file__).startswith({stdlib!r})"
        cmd = [*iso.uid_prefix(65534), sys.executable, "-I", "-c", check]
        if _runs(cmd):
            return iso
    return Isolation(unshare, False)


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=20, cwd="/").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _probe_unshare(root: bool) -> list[str]:
    tool = shutil.which("unshare")
    candidates = []
    if tool:
        base = [tool, "--net", "--pid", "--fork", "--kill-child"]
        # without root, the namespaces need a user namespace of their own
        candidates = [base] if root else [[*base, "--map-root-user"]]
    for prefix in candidates:
        if _runs([*prefix, sys.executable, "-I", "-c", "pass"]):
            return prefix
    return []


def _read_roots() -> list[str]:
    """What the code may read besides its scratch folder: the Python installation."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages())
    roots |= {"/dev/urandom", "/dev/zero", "/etc/localtime", "/usr/share/zoneinfo"}
    roots.add(str(RUNNER))  # its own source (tracebacks read it)
    return sorted(os.path.realpath(r) for r in roots if r)


def _user_process_count() -> int:
    uid, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


class LocalSandbox:
    """Runs programs with `limits`, at most `workers` at once (`submit` from any thread)."""

    def __init__(self, limits: SandboxLimits | None = None, workers: int = 4, audit: bool = True):
        self.limits = limits or SandboxLimits()
        self.audit = audit
        self.isolation = probe_isolation()
        self._read_roots = _read_roots()
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
        scratch = Path(tempfile.mkdtemp(prefix="treadle-sandbox-"))
        uid = 100_000 + secrets.randbelow(1 << 30) if self.isolation.drop_uid else None
        try:
            self._write_files(scratch, {**(files or {}), "main.py": code}, uid)
            return self._execute(scratch, stdin, timeout_s or self.limits.timeout_s, uid)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

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

    # ---- one run ---------------------------------------------------------------------------

    def _write_files(self, scratch: Path, files: dict[str, str | bytes], uid: int | None) -> None:
        for name, content in files.items():
            path = (scratch / name).resolve()
            if not path.is_relative_to(scratch.resolve()):
                raise InvalidRequestError(
                    f"files: expected a relative path inside the scratch folder, got {name!r}"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode() if isinstance(content, str) else content
            path.write_bytes(data)
        if uid is not None:
            for p in [scratch, *scratch.rglob("*")]:
                os.chown(p, uid, uid)
        scratch.chmod(0o700)

    def _config(self, scratch: Path, uid: int | None) -> dict:
        lim = self.limits
        # Without a private uid the process count is the user's own: allow what it has now.
        base = 2 if uid is not None else _user_process_count()
        return {
            "scratch": str(scratch),
            "memory_mb": lim.memory_mb,
            "cpu_s": lim.cpu_s,
            "nproc": base + lim.max_procs,
            "file_mb": lim.max_file_mb,
            "uid": uid,
            "audit": self.audit,
            "read_roots": self._read_roots,
            "env": dict(lim.env),
        }

    def _execute(self, scratch: Path, stdin: str, timeout_s: float, uid: int | None) -> RunResult:
        cmd = [
            *self.isolation.unshare,
            *self.isolation.uid_prefix(uid),
            sys.executable,
            "-I",
            str(RUNNER),
            json.dumps(self._config(scratch, uid)),
        ]
        # stdin from an unlinked file: a program that never reads it cannot block the writer
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        try:
            out, err, reason = self._communicate(proc, start + timeout_s)
        finally:
            self._kill(proc, uid)
            stdin_file.close()
        rc = proc.returncode
        wall = time.monotonic() - start
        status = reason or _status_from_code(rc)
        return RunResult(
            status=status,
            exit_code=rc,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            wall_s=wall,
            truncated=reason == "output_limit",
            pid=proc.pid,
        )

    def _communicate(
        self, proc: subprocess.Popen, deadline: float
    ) -> tuple[bytes, bytes, str | None]:
        """Collect capped output; the reason the run was cut short, if it was."""
        cap = self.limits.max_output_bytes
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        with selectors.DefaultSelector() as sel:
            for f in bufs:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "timeout"
                for key, _ in sel.select(min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = bufs[key.fileobj]
                    buf += chunk
                    if len(buf) > cap:
                        del buf[cap:]
                        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "output_limit"
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "timeout"
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), None

    def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
        """Everything the run started dies: its session, and (without a pid namespace) any
        process of its private uid or session that escaped."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if not self.isolation.unshare:
            for pid in _stray_processes(proc.pid, uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for f in (proc.stdout, proc.stderr):
            f.close()


def _stray_processes(session: int, uid: int | None) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            sid = int(stat.rsplit(")", 1)[1].split()[3])
            if sid == session or (uid is not None and entry.stat().st_uid == uid):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _status_from_code(rc: int) -> str:
    if rc == 0:
        return "ok"
    if rc == _runner.EXIT_BLOCKED:
        return "blocked"
    if rc == _runner.EXIT_MEMORY:
        return "memory"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    if sig:
        return _KILL_SIGNALS.get(sig, "error")
    return "error"
