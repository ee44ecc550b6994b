"""How the sandbox finds its isolation: it refuses to start without bubblewrap (unless told
`unsafe`), finds per-run cgroups (v1 and v2 trees), hides installed packages, and builds its
seccomp filter."""

from __future__ import annotations

import os
import struct
import subprocess
import time

import pytest

from treadle.sandbox import (
    LocalSandbox,
    SandboxLimits,
    SandboxUnavailableError,
    box,
    local,
    probe_isolation,
    seccomp,
)
from treadle.sandbox.cgroup import CgroupRoots, RunCgroup, find_cgroups


@pytest.fixture
def no_bwrap(monkeypatch):
    """This process as if bubblewrap were not installed (the probe runs again)."""
    monkeypatch.setattr(local, "_probed", None)
    monkeypatch.setattr(box, "find_bwrap", lambda: None)


def test_without_bubblewrap_it_refuses_and_says_how_to_install(no_bwrap):
    with pytest.raises(SandboxUnavailableError) as info:
        LocalSandbox(SandboxLimits(timeout_s=5), workers=1)
    message = str(info.value)
    assert "apt-get install bubblewrap" in message and "dnf install bubblewrap" in message
    assert "unsafe=True" in message and "--unsafe_local_sandbox" in message
    assert isinstance(info.value, RuntimeError)


def test_unsafe_runs_without_bubblewrap_as_a_plain_process(no_bwrap):
    with LocalSandbox(SandboxLimits(timeout_s=5), workers=1, unsafe=True) as sandbox:
        assert sandbox.isolation.box is None
        assert "NO BOX" in sandbox.isolation.describe()
        r = sandbox.run("import os\nprint(input()[::-1], os.getcwd() != '/sandbox')", stdin="ab")
        assert (r.status, r.stdout) == ("ok", "ba True\n"), r.stderr
        assert sandbox.run("while True:\n    pass", timeout_s=0.5).status == "timeout"
        assert sandbox.run("import os\nos.fork()").status == "blocked"  # the hook still works


def test_this_machine_has_a_box():
    iso = probe_isolation()
    assert iso.box is not None, iso.problem  # `make sysdeps` installs bubblewrap
    assert "bubblewrap" in iso.describe()


def test_installed_packages_and_treadle_are_hidden():
    layout = probe_isolation().box
    if layout is None:
        pytest.skip("no bubblewrap here")
    import site

    for folder in site.getsitepackages():
        real = os.path.realpath(folder)
        if any(real == b or real.startswith(b + "/") for b in layout.binds):
            assert real in layout.hidden
    assert "/usr" in layout.binds and not any(b.startswith(("/home", "/tmp")) for b in layout.binds)
    assert not any(b in ("/etc", "/var", "/root", "/srv", "/home") for b in layout.binds)
    args = layout.argv(1 << 20, {}, None)
    assert "/proc" in args and "--die-with-parent" in args and "--new-session" in args


def test_cgroup_v1_tree(tmp_path):
    mountinfo = (
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    )
    own = "8:pids:/\n4:memory:/jobs/abc\n0::/\n"
    memory = tmp_path / "sys/fs/cgroup/memory/jobs/abc"
    pids = tmp_path / "sys/fs/cgroup/pids"
    for folder in (memory, pids):
        folder.mkdir(parents=True)
        (folder / "cgroup.procs").write_text("")
    roots = find_cgroups(mountinfo, own, root=str(tmp_path))
    assert roots == CgroupRoots(1, memory, pids)
    run = RunCgroup(roots, 256 << 20, 7)
    made = {d.parent: d for d in run.dirs}
    assert (made[memory] / "memory.limit_in_bytes").read_text() == str(256 << 20)
    assert (made[pids] / "pids.max").read_text() == "7"
    cmd = run.wrap(["bwrap", "true"])
    assert cmd[-3:] == ["--", "bwrap", "true"] and str(made[memory] / "cgroup.procs") in cmd
    assert not run.oom_killed()
    (made[memory] / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 2\n")
    assert run.oom_killed()


def test_cgroup_v2_tree_uses_the_first_folder_that_hands_both_down(tmp_path):
    mountinfo = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    own = "0::/system.slice/treadle.service\n"
    top = tmp_path / "sys/fs/cgroup"
    service = top / "system.slice/treadle.service"
    service.mkdir(parents=True)
    (service / "cgroup.subtree_control").write_text("")
    (top / "system.slice/cgroup.subtree_control").write_text("cpu memory pids\n")
    roots = find_cgroups(mountinfo, own, root=str(tmp_path))
    assert roots == CgroupRoots(2, top / "system.slice", top / "system.slice")
    run = RunCgroup(roots, 1 << 30, 9)
    assert (run.dirs[0] / "memory.max").read_text() == str(1 << 30)
    assert (run.dirs[0] / "pids.max").read_text() == "9"
    (run.dirs[0] / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert run.oom_killed()
    # neither controller handed down anywhere: none
    (top / "system.slice/cgroup.subtree_control").write_text("cpu\n")
    assert find_cgroups(mountinfo, own, root=str(tmp_path)) is None


def test_a_real_run_cgroup_holds_its_processes_and_is_removed():
    roots = probe_isolation().cgroups
    if roots is None:
        pytest.skip("no writable cgroups here")
    run = RunCgroup(roots, 64 << 20, 3)
    made = list(run.dirs)
    proc = subprocess.Popen(run.wrap(["sleep", "30"]))
    try:
        deadline = time.monotonic() + 5
        while proc.pid not in run.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.pid in run.pids()
    finally:
        run.remove()
        proc.wait()
    assert proc.returncode == -9 and not run.dirs
    assert made and not any(d.exists() for d in made)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_filter_is_well_formed(machine):
    prog = seccomp.build_filter(machine)
    assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 64
    ops = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert ops[0] == (0x20, 0, 0, 4)  # load the architecture first
    assert ops[-1][0] == 0x06 and ops[-2][0] == 0x06  # ends with return values
    with pytest.raises(ValueError, match="seccomp"):
        seccomp.build_filter("sparc")
