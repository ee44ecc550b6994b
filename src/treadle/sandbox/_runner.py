"""The sandbox's inside: take the files, drop to the run's uid, set the limits, run main.py.

Run as `python -I -S -c <this source> CONFIG_JSON` (stdlib only: nothing of the project is
visible in there). The files come through an inherited read-only descriptor (`payload_fd`, a
JSON {"files": [[name, base64], ...]}), closed before the untrusted code starts. As root (inside
a box bubblewrap started as root, with CAP_SETUID and CAP_SETGID only) it first switches to
the run's own unprivileged uid/gid, which empties every capability set.

Then it applies the rlimits, enters the scratch folder and, unless told not to, installs the
audit hook: a convenience that ends a run with EXIT_BLOCKED (verdict `blocked`) as soon as it
tries what it has no business doing (a new process, a socket, a signal, a file outside its
scratch and the standard library). It guards the standard library only (gc, ctypes or
_posixsubprocess get past it): the box, the cgroup and the rlimits are the boundary.
A MemoryError that reaches the top ends the run with EXIT_MEMORY.
"""

import binascii
import json
import os
import resource
import runpy
import sys
import traceback

EXIT_BLOCKED = 120
EXIT_MEMORY = 121
EXIT_SETUP = 122  # the runner itself could not set the run up

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROCESS_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.exec",
    "os.system",
    "os.startfile",
    "subprocess.Popen",
    "pty.spawn",
}
_SIGNAL_EVENTS = {"os.kill", "os.killpg", "signal.pthread_kill"}
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
_NET_EVENTS |= {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
# events whose path arguments must all lie inside the writable folders
_WRITE_PATH_EVENTS = {
    "os.remove": 1,
    "os.rmdir": 1,
    "os.mkdir": 1,
    "os.rename": 2,
    "os.replace": 2,
    "os.chmod": 1,
    "os.chown": 1,
    "os.truncate": 1,
    "os.utime": 1,
    "os.chdir": 1,
    "os.chflags": 1,
    "os.setxattr": 1,
    "os.removexattr": 1,
    "shutil.rmtree": 1,
    "shutil.move": 2,
    "shutil.copyfile": 2,
}
_READ_PATH_EVENTS = {"os.listdir": 1, "os.scandir": 1, "glob.glob": 1, "os.getxattr": 1}
_ALWAYS_BLOCKED = {"os.symlink", "os.link", "resource.setrlimit"}


def _blocked(event: str, detail: object) -> None:
    try:
        os.write(2, f"\n[sandbox] blocked: {event} {detail!r:.200}\n".encode())
    finally:
        os._exit(EXIT_BLOCKED)


def _install_audit_hook(write_roots: tuple[str, ...], read_roots: tuple[str, ...]) -> None:
    readable = (*write_roots, *read_roots)
    busy = [False]  # realpath itself may raise events: do not recurse

    def inside(path: object, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int) or path is None:
            return True  # an already open descriptor, or the current folder (checked on chdir)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        real = os.path.realpath(os.fspath(path))
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            _check(event, args)
        finally:
            busy[0] = False

    def _check(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if not inside(path, write_roots if writes else readable):
                _blocked(event, path)
        elif event in _PROCESS_EVENTS or event in _SIGNAL_EVENTS or event in _ALWAYS_BLOCKED:
            _blocked(event, args[:2])
        elif event == "socket.__new__":
            if len(args) > 1 and args[1] != getattr(os, "AF_UNIX", 1):
                _blocked(event, args[1:])
        elif event in _NET_EVENTS:
            _blocked(event, args[1:2])
        elif event in _WRITE_PATH_EVENTS:
            for path in args[: _WRITE_PATH_EVENTS[event]]:
                if not inside(path, write_roots):
                    _blocked(event, path)
        elif event in _READ_PATH_EVENTS:
            if not inside(args[0] if args else None, readable):
                _blocked(event, args[0])

    sys.addaudithook(hook)


def _read_roots() -> tuple[str, ...]:
    """What the hook lets a run read besides its writable folders: the standard library (run
    with -I -S, sys.path holds nothing else yet)."""
    roots = {sys.prefix, sys.exec_prefix, *sys.path, "/usr/share/zoneinfo", "/etc/localtime"}
    roots |= {"/dev/urandom", "/dev/zero"}
    return tuple(sorted(os.path.realpath(r) for r in roots if r))


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"still uid {os.getuid()} after switching to {uid}")


def _write_files(scratch: str, payload_fd: int) -> None:
    chunks = []
    while chunk := os.read(payload_fd, 1 << 20):
        chunks.append(chunk)
    os.close(payload_fd)
    for name, data in json.loads(b"".join(chunks))["files"]:
        rel = os.path.normpath(name)
        if rel.startswith(("/", "..")) or rel == ".":
            raise ValueError(f"files: expected a relative path inside the scratch, got {name!r}")
        path = os.path.join(scratch, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(binascii.a2b_base64(data))


def _set_limits(cfg: dict) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg.get("memory_mb"):
        limit = int(cfg["memory_mb"]) * mb
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if cfg.get("cpu_s"):
        cpu = int(cfg["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if cfg.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (int(cfg["nproc"]), int(cfg["nproc"])))
    if cfg.get("file_mb"):
        limit = int(cfg["file_mb"]) * mb
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def _setup(cfg: dict) -> str:
    if cfg.get("uid") is not None:
        _drop_to(int(cfg["uid"]))
    scratch = cfg["scratch"]
    _write_files(scratch, int(cfg["payload_fd"]))
    _set_limits(cfg)
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update(cfg.get("env", {}))
    readable = _read_roots()
    sys.path[:0] = [scratch]
    if cfg.get("audit", True):
        writable = (os.path.realpath(scratch), "/dev/null", *cfg.get("private_tmp", []))
        _install_audit_hook(writable, readable)
    return os.path.join(scratch, cfg.get("main", "main.py"))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        main_py = _setup(cfg)
    except BaseException:  # noqa: BLE001 - set-up failed: say so, never run the code
        traceback.print_exc()
        os._exit(EXIT_SETUP)
    code = 0
    try:
        sys.argv = [main_py]
        runpy.run_path(main_py, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except MemoryError:
        os.write(2, b"\nMemoryError\n")
        os._exit(EXIT_MEMORY)
    except BaseException:  # noqa: BLE001 - reported as the program's error
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
