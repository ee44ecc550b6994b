"""Per-run cgroups: one limit on the total memory and the number of processes of a run.

rlimits are per process (five processes under a 1 GB RLIMIT_AS hold 5 GB); a cgroup counts
everything the run starts, its tmpfs pages included. `find_cgroups` looks once for a place to
make them: cgroup v2 where the host's memory and pids controllers live there (the first folder,
from the server's own cgroup up, that hands both down and that we may write), else the v1
`memory` and `pids` hierarchies (a child of the server's own cgroup, so the host's limits on the
server still hold). `RunCgroup` makes one per run, and kills and removes it afterwards. Without
write access (not root, a read-only cgroupfs) there is none, and the caller falls back to
rlimits alone. `own_oom_kills` reads how many processes of the caller's own memory cgroup
the OOM killer has killed (the server's supervisor: was a dead worker's SIGKILL an OOM kill?).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# The wrapper a run starts under: it moves itself into the run's cgroups, then execs the run,
# so nothing the run starts is ever outside them. Exit code 125: it could not join.
JOIN_EXIT = 125
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class CgroupRoots:
    """Where per-run cgroups are made: one folder per controller (the same one on v2)."""

    version: int  # 1 or 2
    memory: Path | None
    pids: Path | None

    def describe(self) -> str:
        kinds = [k for k in ("memory", "pids") if getattr(self, k) is not None]
        return f"cgroup v{self.version} ({' + '.join(kinds)})"


def find_cgroups(
    mountinfo: str | None = None, own: str | None = None, root: str = ""
) -> CgroupRoots | None:
    """The parents for per-run cgroups on this machine, or None. `mountinfo` and `own` are the
    texts of /proc/self/mountinfo and /proc/self/cgroup (read when not given); `root` prefixes
    every path (tests build a fake tree)."""
    if mountinfo is None or own is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    mounts = _cgroup_mounts(mountinfo)
    paths = _own_cgroups(own)
    if "" in mounts and "" in paths:
        found = _v2_parent(root + mounts[""][0], mounts[""][1], paths[""])
        if found is not None:
            return found
    dirs: dict[str, Path] = {}
    for ctl in ("memory", "pids"):
        if ctl in mounts and ctl in paths:
            mountpoint, mount_root = mounts[ctl]
            folder = _folder(root + mountpoint, mount_root, paths[ctl])
            if (folder / "cgroup.procs").exists() and os.access(folder, os.W_OK):
                dirs[ctl] = folder
    if not dirs:
        return None
    return CgroupRoots(1, dirs.get("memory"), dirs.get("pids"))


def oom_kills(
    folder: Path, files: tuple[str, ...] = ("memory.events", "memory.oom_control")
) -> int | None:
    """How many processes of a memory cgroup the OOM killer has killed (the `oom_kill` line
    of the first of `files` it has), or None."""
    for file in files:
        try:
            lines = (folder / file).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value or 0)
    return None


def own_oom_kills() -> int | None:
    """How many processes of this process's own memory cgroup (not of cgroups below it) the
    OOM killer has killed: cgroup v2's memory.events.local (memory.events on kernels before
    5.7, which counts those below too), else v1's memory.oom_control. None where neither
    can be read."""
    try:
        mounts = _cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        paths = _own_cgroups(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    for ctl, files in (
        ("", ("memory.events.local", "memory.events")),
        ("memory", ("memory.oom_control",)),
    ):
        if ctl in mounts and ctl in paths:
            if (count := oom_kills(_folder(*mounts[ctl], paths[ctl]), files)) is not None:
                return count
    return None


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """controller ("" for cgroup2) → (mount point, root of the mount)."""
    found: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.setdefault("", (mountpoint, mount_root))
        elif tail[0] == "cgroup":
            for opt in tail[2].split(","):
                if opt in ("memory", "pids"):
                    found.setdefault(opt, (mountpoint, mount_root))
    return found


def _own_cgroups(text: str) -> dict[str, str]:
    """controller ("" for cgroup2) → the server's own cgroup path in that hierarchy."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctls, path = parts
        for ctl in ctls.split(",") if ctls else [""]:
            paths[ctl] = path
    return paths


def _folder(mountpoint: str, mount_root: str, own: str) -> Path:
    """Where a cgroup path (as /proc/self/cgroup names it) is in a mounted hierarchy."""
    return Path(mountpoint) / os.path.relpath(own, mount_root)


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")


def _v2_parent(mountpoint: str, mount_root: str, own: str) -> CgroupRoots | None:
    here = _folder(mountpoint, mount_root, own)
    top = Path(mountpoint)
    while True:
        try:
            handed_down = (here / "cgroup.subtree_control").read_text().split()
        except OSError:
            handed_down = []
        if {"memory", "pids"} <= set(handed_down) and os.access(here, os.W_OK):
            return CgroupRoots(2, here, here)
        if here == top or top not in here.parents:
            return None
        here = here.parent


class RunCgroup:
    """The cgroup(s) of one run: made with its limits, then killed and removed by `remove`."""

    def __init__(self, roots: CgroupRoots, memory_bytes: int, max_pids: int):
        self.roots = roots
        self.dirs: list[Path] = []
        name = f"treadle-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            if roots.version == 2:
                folder = self._make(roots.memory / name)
                _write(folder / "memory.max", memory_bytes)
                _write(folder / "memory.swap.max", 0, optional=True)
                _write(folder / "pids.max", max_pids)
            else:
                if roots.memory is not None:
                    folder = self._make(roots.memory / name)
                    _write(folder / "memory.limit_in_bytes", memory_bytes)
                    # with swap accounting, swap counts too (set after: it may not be lower)
                    _write(folder / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                if roots.pids is not None:
                    _write(self._make(roots.pids / name) / "pids.max", max_pids)
        except BaseException:
            self.remove()
            raise

    def _make(self, folder: Path) -> Path:
        folder.mkdir()
        self.dirs.append(folder)
        return folder

    def wrap(self, cmd: list[str], sh: str = "/bin/sh") -> list[str]:
        """`cmd`, started inside this cgroup."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return [sh, "-c", _JOIN, "sh", *procs, "--", *cmd]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit."""
        return any(oom_kills(folder) for folder in self.dirs)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for folder in self.dirs:
            try:
                found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return found

    def kill(self, spare: int | None = None) -> None:
        """SIGKILL every process of the run (but `spare`)."""
        if spare is None:
            for folder in self.dirs:
                try:
                    (folder / "cgroup.kill").write_text("1")  # v2, Linux 5.14+
                    return
                except OSError:
                    pass
        for pid in self.pids() - {spare}:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill what is left and remove the folders (a dying process keeps them busy a moment)."""
        deadline = time.monotonic() + wait_s
        while self.dirs:
            self.kill()
            for folder in list(self.dirs):
                try:
                    folder.rmdir()
                    self.dirs.remove(folder)
                except FileNotFoundError:
                    self.dirs.remove(folder)
                except OSError:
                    pass
            if not self.dirs or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _write(path: Path, value: int, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if not optional:
            raise
