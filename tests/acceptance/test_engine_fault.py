"""An error that leaves the device unusable ends its worker, not its neighbours' requests.

The workers of a real `treadle serve` run with a fault planted through Python's own
`sitecustomize` hook (nothing in the server knows of it): a train batch or a sample whose
prompt begins with POISON raises torch.AcceleratorError, CUDA's "illegal memory access",
and from then on every engine call of that process fails the same way, as a poisoned CUDA
context does; one that begins with SEGFAULT really segfaults the worker. Another tenant's
request that shared the engine call with it must still succeed, with the right numbers,
and the hostile request must fail with a clear error after two faults instead of crashing
every new worker forever. One that begins with OOM allocates host memory until the
kernel's OOM killer kills the worker (in a memory cgroup of its own that the test makes).
One that begins with LATENT runs well until the test breaks the
device (a file beside the hook): then the run of it that restores its model faults. A
model (or a sampler's ref) named in another file beside the hook crashes its worker (a
segfault, or a device fault) while the worker loads its state (or weights) to restore it.

    .venv/bin/python -m pytest -q tests/acceptance/test_engine_fault.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.engine.device_faults import device_usable, is_device_fault
from treadle.errors import InvalidRequestError
from treadle.launch import ServerProcess
from treadle.protocol.faults import EXIT_ENGINE_FAULT, MAX_FAULTS
from treadle.protocol.flight_recorder import (
    FlightRecorder,
    clear_crash_logs,
    read_crash,
    read_running,
)
from treadle.sandbox.cgroup import RunCgroup, find_cgroups

TINY = "treadle/tiny-llama"
POISON = [13, 13, 13, 13, 13]
SEGFAULT = [14, 14, 14, 14, 14]
LATENT = [15, 15, 15, 15, 15]
OOM = [16, 16, 16, 16, 16]
MEMORY_LIMIT = 3 << 30  # the test server's memory cgroup: its API and worker fit in 1.5 GB
CGROUP_ENV = "TREADLE_TEST_CGROUP_PROCS"  # where the server process joins it

SITECUSTOMIZE = f"""
import os
import sys

if "serve" in sys.argv and os.environ.get("{CGROUP_ENV}"):  # the server and its workers
    for procs in os.environ["{CGROUP_ENV}"].split(os.pathsep):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

if "worker" in sys.argv:  # the engine workers only; the API process stays as it is
    import torch

    from treadle.engine import engine, sample

    POISON, SEGFAULT, LATENT, OOM = {POISON}, {SEGFAULT}, {LATENT}, {OOM}
    BROKEN = os.path.join(os.path.dirname(__file__), "device-broken")
    broken = []

    def starts(prompts, head):
        return any(list(p)[: len(head)] == head for p in prompts)

    def check(prompts):
        if starts(prompts, SEGFAULT):
            import ctypes

            ctypes.string_at(0)  # a real segfault: no Python code runs after it
        if starts(prompts, OOM):
            hog = [bytearray(b"x") * (64 << 20) for _ in range(256)]  # written: resident
            raise RuntimeError(f"{{len(hog) * 64}} MB and no OOM kill: no memory limit?")
        latent = os.path.exists(BROKEN) and starts(prompts, LATENT)
        if broken or latent or starts(prompts, POISON):
            broken.append(True)  # the device is gone for this process
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    real_fb, real_sample, real_add = (
        engine.Engine.forward_backward, engine.Engine.sample, sample.DecodeBatch.add
    )

    def forward_backward(self, batches, forward_only=False):
        check([d.tokens for b in batches for d in b.data])
        return real_fb(self, batches, forward_only)

    def sample_all(self, requests):
        check([r.prompt for r in requests])
        return real_sample(self, requests)

    def add(self, requests, stream=None):
        check([r.prompt for r in requests])
        return real_add(self, requests, stream)

    engine.Engine.forward_backward = forward_backward
    engine.Engine.sample = sample_all
    sample.DecodeBatch.add = add

    from treadle.worker import live_weights

    CRASH_RESTORE = os.path.join(os.path.dirname(__file__), "crash-restore")
    real_restore = live_weights.LiveWeights.restore_model
    real_load_sampler = live_weights.LiveWeights.load_sampler

    def crash_if_planted(key):
        # each line of the file beside the hook: "KEY HOW", one crash of that key's load
        lines = open(CRASH_RESTORE).read().split("\\n") if os.path.exists(CRASH_RESTORE) else []
        mine = [line for line in lines if line.startswith(key + " ")]
        if mine:
            lines.remove(mine[0])
            with open(CRASH_RESTORE, "w") as f:
                f.write("\\n".join(lines))
            if mine[0].endswith(" segfault"):
                import ctypes

                ctypes.string_at(0)
            broken.append(True)
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def restore_model(self, model_id, state_dir, samplers):
        crash_if_planted(model_id)
        return real_restore(self, model_id, state_dir, samplers)

    def load_sampler(self, ref, checkpoint_type, directory):
        crash_if_planted(ref)
        return real_load_sampler(self, ref, checkpoint_type, directory)

    live_weights.LiveWeights.load_sampler = load_sampler
    live_weights.LiveWeights.restore_model = restore_model

    if os.environ.get("RANK") == "1":  # a worker group: the fault is on rank 1's device only
        from treadle.engine import train, train_passes

        real_group_fb, real_pass = train.forward_backward, train_passes.forward

        def group_forward_backward(eng, comm, batches, forward_only=False):
            tokens = [d.tokens for b in batches for d in b.data]
            if starts(tokens, POISON):
                broken.append(True)
            crashing.extend(head for head in (SEGFAULT, OOM) if starts(tokens, head))
            return real_group_fb(eng, comm, batches, forward_only)

        def rank_pass(eng, local, *args):
            check(crashing[-1:])
            return real_pass(eng, local, *args)

        crashing = []

        train.forward_backward = group_forward_backward
        train_passes.forward = rank_pass
"""


def test_which_errors_are_device_faults():
    illegal = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    assert is_device_fault(illegal, "cuda:0")
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory"), "cuda:0")
    assert not is_device_fault(InvalidRequestError("data[0]: bad"), "cuda:0")  # never probed
    assert not is_device_fault(RuntimeError("shape mismatch"), "cpu")  # a CPU stays usable
    assert device_usable("cpu") and device_usable(None)


def test_the_flight_recorder_outlives_its_process(tmp_path):
    path = tmp_path / "w.running"
    script = (
        "import os, signal, sys\n"
        "from treadle.protocol.flight_recorder import FlightRecorder, keep_crash_log\n"
        "os.environ['TREADLE_FLIGHT_RECORDER'] = sys.argv[1]\n"
        "keep_crash_log(0)\n"
        "r = FlightRecorder(sys.argv[1])\n"
        "r.record(['a-long-request-id', 'b', 'c'])\n"
        "r.record(['x', 'y'])  # shorter than the last: only these\n"
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], check=False)
    assert done.returncode == -signal.SIGSEGV
    assert read_running(path) == ["x", "y"]
    rank, log = read_crash(path, ranks=2)  # which rank, and its stack
    assert rank == 0 and log.startswith("Fatal Python error: Segmentation fault")
    assert "in <module>" in log
    clear_crash_logs(path, ranks=2)
    assert read_crash(path, ranks=2) is None
    recorder = FlightRecorder(path)  # a new worker starts from nothing
    assert read_running(path) == []
    recorder.record(["z"])
    recorder.clear()
    assert read_running(path) == [] and read_running(tmp_path / "none") == []


def datums(first: list[int], n: int = 9, rows: int = 1) -> list[Datum]:
    seq = first + np.random.default_rng(len(first)).integers(20, 400, n).tolist()
    datum = Datum(
        model_input=ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    return [datum] * rows


def start(tiny_model_dir, tmp_path, monkeypatch, **config) -> ServerProcess:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    # in front of the path the tests run with (a checkout's src/, if they run from one)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )
    config = {"snapshot_every_steps": 2, **config}
    return ServerProcess({TINY: tiny_model_dir}, tmp_path / "data", config=config).start()


@pytest.fixture
def server(tiny_model_dir, tmp_path, monkeypatch):
    s = start(tiny_model_dir, tmp_path, monkeypatch)
    yield s
    s.stop()


@pytest.fixture
def limited_server(tiny_model_dir, tmp_path, monkeypatch):
    """→ start(devices): a server (its worker, or group of ranks) in a memory cgroup of
    MEMORY_LIMIT."""
    roots = find_cgroups()
    if roots is None or roots.memory is None:
        pytest.skip("no memory cgroup can be made here (needs root and a writable cgroupfs)")
    cgroup = RunCgroup(roots, MEMORY_LIMIT, max_pids=1 << 20)
    swap_limits = ("memory.swap.max", "memory.memsw.limit_in_bytes")
    has_swap = len(Path("/proc/swaps").read_text().splitlines()) > 1
    if has_swap and not any((d / f).exists() for d in cgroup.dirs for f in swap_limits):
        cgroup.remove()
        pytest.skip("this machine swaps and its memory cgroups cannot limit swap")
    monkeypatch.setenv(CGROUP_ENV, os.pathsep.join(str(d / "cgroup.procs") for d in cgroup.dirs))
    started = []

    def start_limited(devices: int) -> ServerProcess:
        started.append(start(tiny_model_dir, tmp_path, monkeypatch, devices=devices))
        return started[-1]

    yield start_limited
    for s in started:
        s.stop()
    cgroup.remove()


@pytest.fixture
def group_server(tiny_model_dir, tmp_path, monkeypatch):
    s = start(tiny_model_dir, tmp_path, monkeypatch, devices=2)
    yield s
    s.stop()


def two_tenants(server: ServerProcess) -> tuple:
    """(victim's ServiceClient, hostile's, the victim's training client, the hostile's)."""
    victim_svc = ServiceClient(base_url=server.url, api_key="tml-victim")
    hostile_svc = ServiceClient(base_url=server.url, api_key="tml-hostile")
    victim = victim_svc.create_lora_training_client(TINY, rank=4, seed=1)
    hostile = hostile_svc.create_lora_training_client(TINY, rank=4, seed=2)
    return victim_svc, hostile_svc, victim, hostile


def wait_running(server: ServerProcess, timeout_s: float = 60) -> None:
    """Until the worker's engine runs some call (its flight recorder holds an op)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(read_running(p) for p in server.data_dir.glob("worker-*.running")):
            return
        time.sleep(0.001)
    raise TimeoutError("the engine ran nothing")


def fault_exits(server: ServerProcess) -> int:
    """How many times the supervisor saw a worker exit after an engine fault."""
    line = rf"treadle\.supervisor: .* exited with code {EXIT_ENGINE_FAULT};"
    return len(re.findall(line, server.log()))


def faults_reported(server: ServerProcess) -> list[int]:
    """How many ops were running at each engine fault a worker reported."""
    return [int(n) for n in re.findall(r"engine fault with (\d+) ops running", server.log())]


def crashes_seen(server: ServerProcess) -> list[int]:
    """How many ops each crashed worker's flight recorder held, as the supervisor read it."""
    how = r"crashed \((?:SIGSEGV|rank 1: Segmentation fault)\)|was killed by the kernel's OOM"
    line = rf"treadle\.supervisor: .* (?:{how}).* running (\d+) ops"
    return [int(n) for n in re.findall(line, server.log())]


@pytest.mark.parametrize(
    "where, poison, error",
    [
        ("worker", POISON, "illegal memory access"),
        ("group", POISON, "rank 1: CUDA error: an illegal memory access"),
        ("worker", SEGFAULT, "SIGSEGV"),
        ("group", SEGFAULT, "rank 1: Segmentation fault"),
        ("limited", OOM, "OOM killer"),
        ("limited-group", OOM, "OOM killer"),
    ],
    ids=[
        "device-fault",
        "device-fault-on-rank-1",
        "segfault",
        "segfault-on-rank-1",
        "oom-kill",
        "oom-kill-on-rank-1",
    ],
)
def test_a_poisoned_train_call_restarts_the_worker_and_spares_its_neighbour(
    request, where, poison, error
):
    """The hostile request shares one engine call with its neighbour's, faults the device
    (or segfaults the worker) twice, and is refused; the neighbour's request gets its
    right result. `group`: two gloo ranks, the fault on rank 1's device; rank 0 reports it.
    `segfault`: nothing is reported; the supervisor reads the crashed worker's flight
    recorder. `oom-kill`: the kernel's OOM killer kills the worker (or rank 1) in the
    server's memory cgroup; the supervisor sees that cgroup's oom_kill count grow."""
    if where.startswith("limited"):
        server = request.getfixturevalue("limited_server")(2 if "group" in where else 1)
    else:
        server = request.getfixturevalue("server" if where == "worker" else "group_server")
    victim_svc, hostile_svc, victim, hostile = two_tenants(server)
    clean = datums([5, 6, 7])
    victim.forward_backward(clean, "cross_entropy").result()
    victim.optim_step(AdamParams(learning_rate=1e-2)).result()
    expected = victim.forward(clean, "cross_entropy").result()
    workers = server.children()

    # a third session's long call keeps the engine busy while both arrive, so that the next
    # round runs them as one engine call (the fault's first report names both)
    filler = victim_svc.create_lora_training_client(TINY, rank=4, seed=3)
    long_call = filler.forward_backward(datums([3, 4], n=120) * 32, "cross_entropy")
    wait_running(server)  # a loaded host can take longer than any fixed pause to start it
    bad = hostile.forward_backward(datums(poison, rows=2), "cross_entropy")  # a row per rank
    good = victim.forward_backward(clean, "cross_entropy")
    with pytest.raises(Exception, match="not run again") as caught:
        bad.result(timeout=180)
    assert error in str(caught.value)
    got = good.result(timeout=180)
    for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)

    long_call.result(timeout=180)
    # the shared call, then the hostile op alone, in a fresh process each time; then refused
    if poison in (SEGFAULT, OOM):
        assert crashes_seen(server) == [2, 1] and not faults_reported(server)
    else:
        assert faults_reported(server) == [2, 1]
    if where == "worker" and poison == POISON:  # a group's exit status is torchrun's
        assert fault_exits(server) == MAX_FAULTS
    assert server.children() and server.children() != workers
    # both sessions carry on: the refused request changed nothing, the victim's step counts
    hostile.forward_backward(datums([8, 9]), "cross_entropy").result(timeout=60)
    hostile.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
    victim.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert victim.save_state("after").result(timeout=60).path
    victim_svc.close()
    hostile_svc.close()


def test_a_poisoned_prompt_fails_alone_and_the_decode_batch_it_joined_finishes(server):
    victim_svc = ServiceClient(base_url=server.url, api_key="tml-victim")
    hostile_svc = ServiceClient(base_url=server.url, api_key="tml-hostile")
    victim = victim_svc.create_sampling_client(base_model=TINY)
    hostile = hostile_svc.create_sampling_client(base_model=TINY)
    params = SamplingParams(max_tokens=160, temperature=0.0)
    expected = victim.sample([5, 6, 7], 1, params).result(timeout=60).sequences[0].tokens

    long_one = victim.sample([5, 6, 7], 1, params)  # decoding when the poison joins
    wait_running(server)
    bad = hostile.sample(POISON, 1, SamplingParams(max_tokens=4))
    with pytest.raises(Exception, match="not run again"):
        bad.result(timeout=180)
    assert long_one.result(timeout=180).sequences[0].tokens == expected
    assert faults_reported(server) == [2, 1]  # the prefill beside it, then the poison alone
    assert fault_exits(server) == MAX_FAULTS
    assert hostile.sample([8, 9], 1, params).result(timeout=60).sequences[0].tokens
    victim_svc.close()
    hostile_svc.close()


def test_a_replay_that_keeps_faulting_gives_up_its_model_alone(server, tmp_path):
    """An acknowledged op that ran well faults the device each time it runs again to restore
    its model after a crash: that one model is given up, with a clear error to its pending
    requests, instead of every new worker faulting forever; the other session is restored
    exactly (its own replays beside the faulting one) and goes on. The give-up is for good:
    the model's later requests hear why, and a whole-server restart does not try its
    restore again (two more worker faults, while every session of that base model waits)."""
    victim_svc, hostile_svc, victim, hostile = two_tenants(server)
    clean = datums([5, 6, 7])
    victim.forward_backward(clean, "cross_entropy").result()
    victim.optim_step(AdamParams(learning_rate=1e-2)).result()
    hostile.forward_backward(datums(LATENT), "cross_entropy").result()  # runs well, once
    victim.forward_backward(clean, "cross_entropy").result()  # accumulated: replayed too
    expected = victim.forward(clean, "cross_entropy").result()

    (tmp_path / "hook" / "device-broken").touch()
    for pid in server.children():
        os.kill(pid, signal.SIGKILL)
    pending = hostile.forward(datums([8, 9]), "cross_entropy")  # acknowledged while down
    with pytest.raises(Exception, match="could not be restored after a restart") as caught:
        pending.result(timeout=180)
    assert "which ran before and is run again to restore its state" in str(caught.value)
    assert "illegal memory access" in str(caught.value)

    got = victim.forward(clean, "cross_entropy").result(timeout=180)
    for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    reports = faults_reported(server)
    assert len(reports) == MAX_FAULTS and reports[-1] == 1  # the last: the replay alone
    assert fault_exits(server) == MAX_FAULTS
    with pytest.raises(Exception, match="could not be restored after a restart"):
        hostile.forward_backward(datums([8, 9]), "cross_entropy").result(timeout=60)
    victim.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert victim.save_state("after").result(timeout=60).path
    expected = victim.forward(clean, "cross_entropy").result()

    server.kill()  # the whole server, the device still broken for LATENT
    server.start()
    got = victim.forward(clean, "cross_entropy").result(timeout=180)
    for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    with pytest.raises(Exception, match="which ran before and is run again to restore"):
        hostile.forward(datums([8, 9]), "cross_entropy").result(timeout=60)
    assert fault_exits(server) == MAX_FAULTS  # its restore was not tried again
    victim_svc.close()
    hostile_svc.close()


def test_a_worker_that_dies_while_restoring_a_model_restores_it_on_the_next(server, tmp_path):
    """A worker killed from outside, whose successor segfaults while loading one model's
    state: that model is not given up (a crash of that worker was not its fault, as far
    as anyone knows yet); the next worker restores it exactly, and the requests
    acknowledged while the workers were down run."""
    victim_svc, hostile_svc, victim, other = two_tenants(server)
    clean = datums([5, 6, 7])
    for client in (victim, other):
        client.forward_backward(clean, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    victim.forward_backward(clean, "cross_entropy").result()  # accumulated: replayed
    expected = victim.forward(clean, "cross_entropy").result()

    (tmp_path / "hook" / "crash-restore").write_text(f"{victim.model_id} segfault")
    for pid in server.children():
        os.kill(pid, signal.SIGKILL)  # from outside: blames nothing
    pending = victim.forward(clean, "cross_entropy")  # acknowledged while down
    got = pending.result(timeout=180)
    for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    assert crashes_seen(server) == [1]  # the restore, blamed once
    assert (tmp_path / "hook" / "crash-restore").read_text() == ""
    victim.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
    other.forward_backward(clean, "cross_entropy").result(timeout=60)
    assert victim.save_state("after").result(timeout=60).path
    victim_svc.close()
    hostile_svc.close()


def test_a_model_whose_restore_keeps_crashing_its_worker_is_given_up_alone(server, tmp_path):
    """One model's state crashes every worker that loads it (a device fault, then a
    segfault): after MAX_FAULTS such crashes that model is given up with a clear reason,
    instead of its workers restarting forever while every session of the base model
    waits; the other session is restored exactly and goes on."""
    victim_svc, hostile_svc, victim, hostile = two_tenants(server)
    clean = datums([5, 6, 7])
    for client in (victim, hostile):
        client.forward_backward(clean, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    expected = victim.forward(clean, "cross_entropy").result()

    crashes = [f"{hostile.model_id} {how}" for how in ("fault", "segfault", "fault")]
    (tmp_path / "hook" / "crash-restore").write_text("\n".join(crashes))
    for pid in server.children():
        os.kill(pid, signal.SIGKILL)
    pending = hostile.forward(clean, "cross_entropy")
    with pytest.raises(Exception, match="could not be restored after a restart") as caught:
        pending.result(timeout=180)
    assert "while loading its state to restore it" in str(caught.value)
    assert "Segmentation fault" in str(caught.value) or "SIGSEGV" in str(caught.value)
    got = victim.forward(clean, "cross_entropy").result(timeout=180)
    for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    assert faults_reported(server) == [1] and crashes_seen(server) == [1]
    assert (tmp_path / "hook" / "crash-restore").read_text() == crashes[2]  # not tried again
    with pytest.raises(Exception, match="could not be restored after a restart"):
        hostile.forward_backward(clean, "cross_entropy").result(timeout=60)
    victim.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
    victim_svc.close()
    hostile_svc.close()


def test_a_worker_that_dies_while_loading_a_sampler_again_keeps_that_sampler(server, tmp_path):
    """A sampler of a saved checkpoint, whose reload after a kill segfaults the next worker:
    the sampler is not given up for it, not even for a moment (the worker's death was no
    fault of the sampler's); the worker after restores it, and it samples the same greedy
    tokens as before."""
    victim_svc, hostile_svc, victim, _ = two_tenants(server)
    victim.forward_backward(datums([5, 6, 7]), "cross_entropy").result()
    victim.optim_step(AdamParams(learning_rate=1e-2)).result()
    saved = victim.save_weights_for_sampler("s1").result(timeout=60)
    sampler = victim_svc.create_sampling_client(model_path=saved.path)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = sampler.sample([5, 6, 7], 1, params).result(timeout=60).sequences[0].tokens

    crash = tmp_path / "hook" / "crash-restore"
    crash.write_text(f"sampler:{sampler.sampling_session_id} segfault")
    for pid in server.children():
        os.kill(pid, signal.SIGKILL)
    got = sampler.sample([5, 6, 7], 1, params).result(timeout=180).sequences[0].tokens
    assert got == expected
    assert crash.read_text() == ""  # its reload did crash a worker once
    # nor was it reported as lost on the way (the operator's log, and its 404's reason)
    assert "could not be loaded again" not in server.log()
    victim_svc.close()
    hostile_svc.close()
