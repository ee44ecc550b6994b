"""The sandbox's child side: set the limits on itself, then run untrusted code.

Run as `python -I _runner.py CONFIG_JSON` (stdlib only: the project is not importable in
there). It forks once: the parent (pid 1 when it runs in a new pid namespace) only waits and
reports the child's exit status; the child applies the rlimits (as root, setpriv has already
dropped it to the sandbox uid), enters the scratch folder, installs the audit hook, runs main.py.

A blocked operation ends the run at once with EXIT_BLOCKED (it cannot be caught by the
untrusted code); a MemoryError that reaches the top ends it with EXIT_MEMORY.
"""

import json
import os
import resource
import runpy
import signal
import sys
import traceback

EXIT_BLOCKED = 120
EXIT_MEMORY = 121

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
# events whose path arguments must all lie inside the scratch folder
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


def _install_audit_hook(scratch: str, read_roots: list[str]) -> None:
    write_roots = (scratch, "/dev/null")
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


def _child(cfg: dict) -> None:
    _set_limits(cfg)
    os.chdir(cfg["scratch"])
    os.environ.clear()
    os.environ.update(cfg.get("env", {}))
    sys.path[:0] = [cfg["scratch"]]
    if cfg.get("audit", True):
        _install_audit_hook(os.path.realpath(cfg["scratch"]), cfg.get("read_roots", []))
    code = 0
    try:
        main = os.path.join(cfg["scratch"], cfg.get("main", "main.py"))
        sys.argv = [main]
        runpy.run_path(main, run_name="__main__")
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


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pid = os.fork()
    if pid == 0:
        try:
            _child(cfg)
        except MemoryError:
            os._exit(EXIT_MEMORY)
        except BaseException:  # noqa: BLE001 - set-up failed: say so, never run the code
            traceback.print_exc()
            os._exit(1)
    # pid 1 of a pid namespace ignores signals it has no handler for: exit on them instead.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(128 + signal.SIGTERM))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
