"""CPU threads of one model call: a call of a few tokens runs on one.

torch splits an op across its intra-op threads (OpenMP). For a call of a handful of tokens
every op is too small to gain from that, while each parallel region still wakes the other
threads and waits at its barrier; and in a server, those threads take the cores that the API
and the client need during the call. Measured on 2 cores with the small tiny-llama,
in-process:

| call | 1 thread | 2 threads |
|---|---|---|
| forward of 1 / 4 / 8 tokens | 12.7 / 13.6 / 14.4 ms | 13.0 / 14.8 / 12.8 ms |
| sampling 32 tokens for 1 / 2 / 4 rows | 338 / 382 / 406 ms | 354 / 406 / 418 ms |
| sampling 16 tokens for 8 rows | 226 ms | 198 ms |

Through `treadle serve`, a 1-token forward's round trip is 0.6-0.8 ms shorter on one thread
(the same server switched between the two, blocks of 5 calls alternating, 100 pairs).
From 8 tokens a call on, the threads pay for themselves (8×64: 82 ms on two, 154 on one).
A decode step feeds one token per row, so a step of up to SMALL_CALL_TOKENS rows runs on
one thread too. On an accelerator the host threads only launch kernels: nothing changes.

torch keeps the setting per OS thread, and a thread's first parallel op copies the latest
value set anywhere: another thread whose first torch work fell inside such a call would keep
one thread. The engine loop does all of an engine's tensor work on its own thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Calls of at most this many tokens (rows × positions) run on one thread.
SMALL_CALL_TOKENS = 4


class CallThreads:
    """Within the block, `fit(tokens)` before each model call sets its threads: one for a
    small call, all of them otherwise. The setting is restored after the block (optimizer
    steps and saves keep every thread)."""

    def __enter__(self) -> CallThreads:
        self.all = self.now = torch.get_num_threads()
        return self

    def fit(self, tokens: int) -> None:
        want = 1 if tokens <= SMALL_CALL_TOKENS else self.all
        if want != self.now:
            torch.set_num_threads(want)
            self.now = want

    def __exit__(self, *exc: object) -> None:
        if self.now != self.all:
            torch.set_num_threads(self.all)


@contextlib.contextmanager
def threads_for(tokens: int) -> Iterator[None]:
    """One model call of `tokens` tokens (rows × positions) in the block."""
    with CallThreads() as threads:
        threads.fit(tokens)
        yield
