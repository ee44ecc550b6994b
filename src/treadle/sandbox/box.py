"""The bubblewrap box a local run lives in: what it sees, and what it may do.

Inside, a run sees a root of its own (read-only) holding only:
  - /usr, /bin, /lib* and the Python installation the server's interpreter is based on
    (read-only, set-uid bits ignored), with every site-packages/dist-packages folder in them
    and the treadle package itself hidden under an empty read-only tmpfs: no installed
    package, no data file of the grader, no server code;
  - /etc/ld.so.cache (where the dynamic linker finds libraries) and nothing else of /etc;
  - its scratch folder /sandbox, and /tmp and /dev/shm: three private tmpfs of
    `scratch_mb` each, gone when the run ends;
  - a fresh /proc of a new pid namespace (only the run's own processes) and a minimal /dev.
It runs in new mount, pid, network (a loopback of its own), ipc, uts and cgroup namespaces,
with no capabilities, `--die-with-parent`, `--new-session`, and the seccomp filter of
seccomp.py. When the server runs as root, bubblewrap runs without a user namespace and the
run switches to a fresh unprivileged uid/gid first thing, so file permissions apply to it even
for root's files; otherwise a user namespace maps the server's own uid.
"""

from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from treadle.sandbox import seccomp

SCRATCH = "/sandbox"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# what the box needs of bubblewrap; --size (a capped tmpfs, 0.8+) and --disable-userns are used
# when there
REQUIRED_FEATURES = ("--perms", "--remount-ro", "--die-with-parent", "--seccomp", "--dir")


@dataclass(frozen=True)
class BoxLayout:
    """How runs are boxed on this machine; made once by `plan_box`."""

    bwrap: str
    python: str  # the interpreter run inside (the base one, not the server's venv)
    binds: tuple[str, ...]  # host folders bound read-only at the same path
    links: tuple[tuple[str, str], ...]  # (target, path) symlinks such as /lib -> usr/lib
    hidden: tuple[str, ...]  # folders inside the binds, masked by an empty tmpfs
    as_root: bool  # bubblewrap runs as root, without a user namespace; the run drops its uid
    sized_tmpfs: bool  # this bubblewrap caps a tmpfs (--size)
    disable_userns: bool  # this bubblewrap knows --disable-userns (user namespace mode only)
    seccomp: bytes | None  # the filter (None on a machine seccomp.py has no numbers for)

    def describe(self) -> str:
        who = "as root, each run under a fresh uid" if self.as_root else "in a user namespace"
        bits = [f"bubblewrap ({who})"]
        if self.seccomp is not None:
            bits.append("seccomp filter")
        if not self.sized_tmpfs:
            bits.append("tmpfs without a size cap (old bubblewrap)")
        return ", ".join(bits)

    def argv(self, scratch_bytes: int, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
        """bubblewrap's arguments up to the command (the interpreter and its arguments)."""
        args = [self.bwrap, "--die-with-parent", "--new-session"]
        if self.as_root:
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
            args += ["--unshare-cgroup", "--cap-drop", "ALL"]
            # only to switch to the run's uid; the switch empties every capability set
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-all", "--unshare-user", "--cap-drop", "ALL"]
            if self.disable_userns:
                args.append("--disable-userns")
        args += ["--hostname", "sandbox"]
        made: set[str] = set()
        trees = {path for _, path in self.links}
        for target, path in self.links:
            args += ["--symlink", target, path]
        for path in self.binds:
            args += _parents(path, made, trees)
            args += ["--ro-bind", path, path]
            trees.add(path)
        args += _parents("/etc/ld.so.cache", made, trees)
        args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for path in self.hidden:
            args += ["--perms", "0555", *self._size(4096), "--tmpfs", path, "--remount-ro", path]
        args += ["--proc", "/proc", "--dev", "/dev"]
        for path in (SCRATCH, "/tmp", "/dev/shm"):
            args += ["--perms", "1777", *self._size(scratch_bytes), "--tmpfs", path]
        args += ["--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return args

    def _size(self, n: int) -> list[str]:
        return ["--size", str(n)] if self.sized_tmpfs else []


def _parents(path: str, made: set[str], trees: set[str]) -> list[str]:
    """Folders above `path` made world-searchable (bubblewrap would make them 0700), except
    those there already: made before, or inside something bound or linked (`trees`)."""
    args = []
    for parent in reversed(Path(path).parents):
        p = str(parent)
        if p == "/" or p in made or _within(p, trees):
            continue
        args += ["--perms", "0755", "--dir", p]
        made.add(p)
    return args


def bwrap_features(bwrap: str) -> set[str]:
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {f for f in (*REQUIRED_FEATURES, "--size", "--disable-userns") if f in text.split()}


def base_python() -> str:
    """The interpreter a venv's python is based on (a venv's own folder is never bound)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def plan_box(bwrap: str, features: set[str]) -> BoxLayout:
    python = base_python()
    links, binds = [], ["/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append(path)
    prefixes = {sys.base_prefix, sys.base_exec_prefix, str(Path(python).parent.parent)}
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if prefix != "/" and not _within(prefix, binds):
            binds.append(prefix)
    link_paths = [path for _, path in links]
    binds = [b for b in binds if not _within(b, [x for x in binds if x != b] + link_paths)]
    return BoxLayout(
        bwrap=bwrap,
        python=python,
        binds=tuple(binds),
        links=tuple(links),
        hidden=tuple(hidden_paths(binds)),
        as_root=os.geteuid() == 0,
        sized_tmpfs="--size" in features,
        disable_userns="--disable-userns" in features,
        seccomp=seccomp.build_filter() if seccomp.machine_supported() else None,
    )


def _within(path: str, roots) -> bool:
    """`path` is one of `roots` or inside one."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def hidden_paths(binds: list[str]) -> list[str]:
    """Every folder of installed packages inside the binds (and treadle itself, wherever it
    lives there), except the standard library."""
    candidates: set[str] = set()
    for root in binds:
        for pattern in ("lib*/python3*/*-packages", "lib/python3/dist-packages"):
            for where in ("", "local", "envs/*"):  # /usr/local; conda's other environments
                candidates.update(glob.glob(os.path.join(root, where, pattern)))
    candidates.update(p for p in sys.path if p)
    candidates.update(site.getsitepackages())
    candidates.add(site.getusersitepackages())
    candidates.add(str(Path(__file__).resolve().parents[1]))  # the treadle package
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    keep = {stdlib, os.path.join(stdlib, "lib-dynload")}
    found = set()
    for path in candidates:
        real = os.path.realpath(path)
        if not os.path.isdir(real) or not _within(real, binds) or real in binds:
            continue
        if real in keep or any(_within(k, [real]) for k in keep):
            continue  # the standard library, or a folder holding it
        found.add(real)
    # a folder inside another hidden one is hidden already (and cannot be mounted on)
    return sorted(p for p in found if not _within(p, [q for q in found if q != p]))


def find_bwrap() -> str | None:
    return shutil.which("bwrap")
