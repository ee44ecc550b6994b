"""When a worker that ended is started again, and when it is not: one policy for the worker
processes (treadle.server.engines.supervisor) and threads (treadle.server.engines.threads).

- A worker that served (said HELLO) and then died is started again, after a backoff that
  doubles while workers keep dying young (a crash loop) and starts over after a long run.
- A worker that could not load its model (treadle.protocol.load_failure) of a model that
  never served is not started again: the server cannot start, and says why.
- A worker that ends before it serves, of a model that served before (its folder deleted
  under it, say), is tried `max_tries` times in a row (the server's worker_start_tries),
  with the backoff, then given up: the model is reported down and its requests fail with
  the reason. So is a model whose first workers keep dying before they serve (a crash at
  every load).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF_S = 10.0
LONG_RUN_S = 60.0  # a worker that ran this long was not crash-looping: the backoff starts over


@dataclass
class Restarts:
    """One replica's worker starts: the backoff and the failures since it last served."""

    max_tries: int = 5  # workers in a row that end before they serve, before giving up
    backoff_s: float = 0.5
    failures: int = 0  # workers in a row that ended before they served
    served: bool = False  # a worker of this replica has served since the server started

    def after_exit(self, served: bool, load_failed: bool, ran_s: float) -> float | None:
        """A worker ended (`served`: it said HELLO; `load_failed`: its model did not load):
        → the seconds to wait before starting the next one, or None to give the model up."""
        if served:
            self.served, self.failures = True, 0
        else:
            self.failures += 1
            if (load_failed and not self.served) or self.failures >= self.max_tries:
                return None
        if ran_s > LONG_RUN_S:
            self.backoff_s = 0.5
        else:
            self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
        return self.backoff_s


def given_up(reason: str, failures: int) -> str:
    """The one line a model given up is reported with (the log, status, its requests)."""
    if failures > 1:
        return f"{reason} (gave up after {failures} workers in a row ended before serving)"
    return reason
