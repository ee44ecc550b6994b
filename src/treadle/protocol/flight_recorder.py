"""What a worker's engine is running right now, in a file that outlives the process.

A worker that crashes (a segfault, an abort in native code) cannot say which ops it was
running, as an engine fault does (treadle.protocol.faults). The engine loop writes
the request ids of each engine call here before it starts and clears them when it ends:
two stores into a memory-mapped page, which the kernel keeps when the process dies. The
supervisor that started the worker reads them after a crash, and the API blames those ops
as it blames the ops of a reported fault. So a request that crashes its worker every time
is refused after MAX_FAULTS crashes instead of crashing every new worker.

Layout: a 4-byte little-endian length, then that many bytes of newline-separated ids. The
ids are written before the length, so a crash between the two leaves the previous record.

Beside it, each process of a worker (every rank of a group) keeps a crash log: Python's
faulthandler writes the fatal signal and every thread's stack there when the process
crashes. It tells the supervisor that a crash ended a group, whose torchrun exit status
says nothing of how its ranks died, and which rank crashed, and gives the operator the
stack. A SIGKILL leaves it empty: a kill from outside blames nothing.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import struct
from pathlib import Path

FLIGHT_RECORDER_ENV = "TREADLE_FLIGHT_RECORDER"  # its path, set by the supervisor
SIZE = 1 << 16
_LEN = struct.Struct("<I")


class FlightRecorder:
    def __init__(self, path: str | Path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    def record(self, request_ids: list[str]) -> None:
        data = "\n".join(request_ids).encode()[: SIZE - _LEN.size]
        self._map[_LEN.size : _LEN.size + len(data)] = data
        self._map[: _LEN.size] = _LEN.pack(len(data))

    def clear(self) -> None:
        self._map[: _LEN.size] = _LEN.pack(0)


def read_running(path: str | Path) -> list[str]:
    """The ids a dead worker's recorder holds (none if it has no file)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return []
    if len(raw) < _LEN.size:
        return []
    (n,) = _LEN.unpack_from(raw)
    ids = raw[_LEN.size : _LEN.size + n].decode(errors="replace")
    return [i for i in ids.split("\n") if i]


def crash_log_path(recorder_path: str | Path, rank: int) -> Path:
    return Path(f"{recorder_path}.rank{rank}.crash")


def keep_crash_log(rank: int) -> None:
    """This process's fatal signals (and its stacks) go to its crash log, if its worker has
    a flight recorder."""
    recorder = os.environ.get(FLIGHT_RECORDER_ENV)
    if recorder:
        # kept open for the process's life: faulthandler writes to its descriptor
        faulthandler.enable(open(crash_log_path(recorder, rank), "w"), all_threads=True)  # noqa: SIM115


def read_crash(recorder_path: str | Path, ranks: int) -> tuple[int, str] | None:
    """(rank, its crash log) of the rank that crashed first, or None. First by the log's
    time: a rank's crash can make the others abort too (NCCL's watchdog does)."""
    crashed = []
    for rank in range(ranks):
        path = crash_log_path(recorder_path, rank)
        try:
            text, when = path.read_text(errors="replace").strip(), path.stat().st_mtime_ns
        except OSError:
            continue
        if text:
            crashed.append((when, rank, text))
    if not crashed:
        return None
    _, rank, text = min(crashed)
    return rank, text


def clear_crash_logs(recorder_path: str | Path, ranks: int) -> None:
    """Before a worker starts: no old crash can be read as its own."""
    for rank in range(ranks):
        crash_log_path(recorder_path, rank).unlink(missing_ok=True)
