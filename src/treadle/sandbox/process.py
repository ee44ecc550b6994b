"""One run of the local sandbox (treadle.sandbox.local): a process under its limits.

_Run builds the run's command (the box's bubblewrap argv, or none when unsafe), its config
for _runner.py and the read-only descriptors that carry the files, stdin and the seccomp
filter; then starts it in its own session (and cgroup), collects capped output until the
deadline, kills everything it started, and reads a status from how it ended. SandboxLimits
are the limits every run gets.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import platform
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from treadle.sandbox import _runner, box
from treadle.sandbox.cgroup import JOIN_EXIT, RunCgroup
from treadle.sandbox.types import RunResult

if TYPE_CHECKING:
    from treadle.sandbox.local import Isolation

RUNNER_SOURCE = Path(_runner.__file__).read_text()
_KILL_SIGNALS = {signal.SIGXCPU: "timeout", signal.SIGKILL: "killed"}


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole run
    cpu_s: int = 10  # per process
    memory_mb: int = 1024  # all the run's processes and tmpfs together (cgroup); also RLIMIT_AS
    max_procs: int = 4  # processes and threads beyond the sandbox's own
    max_output_bytes: int = 1 << 20  # stdout and stderr each
    max_file_mb: int = 16  # one file (RLIMIT_FSIZE)
    scratch_mb: int = 64  # the scratch folder, /tmp and /dev/shm: a tmpfs of this size each
    env: dict[str, str] = field(
        default_factory=lambda: {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    )


@dataclass
class _Run:
    iso: Isolation
    limits: SandboxLimits
    audit: bool

    def run(self, files: dict[str, str | bytes], stdin: str, timeout_s: float) -> RunResult:
        with ExitStack() as stack:
            lim = self.limits
            boxed = self.iso.box is not None
            uid = 100_000 + secrets.randbelow(1 << 30) if boxed and self.iso.box.as_root else None
            if boxed:
                scratch = box.SCRATCH
            else:
                scratch = tempfile.mkdtemp(prefix="treadle-sandbox-")
                stack.callback(shutil.rmtree, scratch, ignore_errors=True)
            cgroup = None
            if self.iso.cgroups is not None:
                # the box's own processes (bubblewrap, its init, the runner) plus the run's
                own = 3 if boxed else 1
                cgroup = RunCgroup(self.iso.cgroups, lim.memory_mb << 20, own + lim.max_procs)
                stack.callback(cgroup.remove)
            encoded = [[n, base64.b64encode(_bytes(c)).decode()] for n, c in files.items()]
            payload_fd = _read_only_fd(json.dumps({"files": encoded}).encode())
            stack.callback(os.close, payload_fd)
            stdin_fd = _read_only_fd(stdin.encode())
            stack.callback(os.close, stdin_fd)
            seccomp_fd = None
            if boxed and self.iso.box.seccomp is not None:
                seccomp_fd = _read_only_fd(self.iso.box.seccomp)
                stack.callback(os.close, seccomp_fd)
            cmd = self._command(self._config(scratch, uid, payload_fd, boxed), seccomp_fd)
            if cgroup is not None:
                cmd = cgroup.wrap(cmd, shutil.which("sh") or "/bin/sh")
            inherited = [fd for fd in (payload_fd, seccomp_fd) if fd is not None]
            return self._execute(cmd, scratch, stdin_fd, inherited, timeout_s, cgroup)

    def _config(self, scratch: str, uid: int | None, payload_fd: int, boxed: bool) -> dict:
        lim = self.limits
        return {
            "scratch": scratch,
            "payload_fd": payload_fd,
            "memory_mb": lim.memory_mb,
            "cpu_s": lim.cpu_s,
            "nproc": self._nproc_base(uid, boxed) + lim.max_procs,
            "file_mb": lim.max_file_mb,
            "uid": uid,
            "audit": self.audit,
            "private_tmp": ["/tmp", "/dev/shm"] if boxed else [],
            "env": {"HOME": scratch, **lim.env},
        }

    def _nproc_base(self, uid: int | None, boxed: bool) -> int:
        """The processes RLIMIT_NPROC counts before the run starts any."""
        if uid is not None:
            return 1  # a fresh uid: only the runner
        if boxed and _kernel() >= (5, 14):
            return 2  # counted per user namespace: bubblewrap's init and the runner
        return _user_process_count() + 1  # every process of this user

    def _command(self, cfg: dict, seccomp_fd: int | None) -> list[str]:
        python = box.base_python()
        if self.iso.box is not None:
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cfg["scratch"]}
            scratch_bytes = self.limits.scratch_mb << 20
            prefix = self.iso.box.argv(scratch_bytes, {**env, **cfg["env"]}, seccomp_fd)
            python = self.iso.box.python
        else:
            prefix = []
        return [*prefix, python, "-I", "-S", "-c", RUNNER_SOURCE, json.dumps(cfg)]

    def _execute(
        self,
        cmd: list[str],
        scratch: str,
        stdin_fd: int,
        inherited: list[int],
        timeout_s: float,
        cgroup: RunCgroup | None,
    ) -> RunResult:
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=inherited,
            cwd="/" if self.iso.box is not None else scratch,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        try:
            out, err, reason = _communicate(proc, start + timeout_s, self.limits.max_output_bytes)
        finally:
            _kill(proc, cgroup, boxed=self.iso.box is not None)
        rc = proc.returncode
        status = reason or _status_from_code(rc, err)
        if cgroup is not None and cgroup.oom_killed() and status not in ("timeout", "output_limit"):
            status = "memory"
        return RunResult(
            status=status,
            exit_code=rc,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            wall_s=time.monotonic() - start,
            truncated=reason == "output_limit",
            pid=proc.pid,
        )


def _bytes(content: str | bytes) -> bytes:
    return content.encode() if isinstance(content, str) else content


def _read_only_fd(data: bytes) -> int:
    """A read-only descriptor (close-on-exec, offset 0) of `data`: a memfd sealed against
    writes where the system allows (reopening it read-write through /proc gets nowhere), else
    an unlinked 0400 temporary file."""
    try:
        fd = os.memfd_create("treadle-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        sealed = True
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:
            fd, sealed = os.dup(f.fileno()), False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sealed:
            seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        os.fchmod(fd, 0o400)
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def _communicate(
    proc: subprocess.Popen, deadline: float, cap: int
) -> tuple[bytes, bytes, str | None]:
    """Collect capped output; the reason the run was cut short, if it was."""
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


def _kill(proc: subprocess.Popen, cgroup: RunCgroup | None, boxed: bool) -> None:
    """Everything the run started dies. Boxed, with a cgroup: all of it but bubblewrap, which
    then reaps the box's init and exits by itself; then bubblewrap's session (its pid namespace
    dies with it), and whatever is left in the cgroup. Without a box: its session."""
    if proc.returncode is None and boxed and cgroup is not None:
        cgroup.kill(spare=proc.pid)
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    if cgroup is not None:
        cgroup.kill()
    if not boxed:
        for pid in _session_processes(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for f in (proc.stdout, proc.stderr):
        f.close()


def _session_processes(session: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[3]) == session:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def _user_process_count() -> int:
    uid, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


def _kernel() -> tuple[int, int]:
    nums = [int(n) for n in re.findall(r"\d+", platform.release())[:2]]
    return (nums + [0, 0])[0], (nums + [0, 0])[1]


def _status_from_code(rc: int, stderr: bytes) -> str:
    if rc == 0:
        return "ok"
    if rc in (_runner.EXIT_SETUP, JOIN_EXIT) or stderr.startswith(b"bwrap: "):
        return "sandbox_error"
    if rc == _runner.EXIT_BLOCKED:
        return "blocked"
    if rc == _runner.EXIT_MEMORY:
        return "memory"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    if sig:
        return _KILL_SIGNALS.get(sig, "error")
    return "error"
