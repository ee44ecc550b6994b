"""Run the server: `treadle serve` parses its flags into a ServerConfig and calls serve();
`treadle worker` configures its process the same way."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import uvicorn

from treadle.server.config import ServerConfig

# How long (in spin iterations: a fraction of a millisecond) an idle OpenMP thread busy-waits
# before it sleeps. libgomp's default (300000, a few ms) is harmless on a machine of its own
# but ruinous when the cores are shared with another busy process (the user's own loop on
# the same box, another job): the team's threads burn whole time slices spinning at every
# barrier, and a 0.45 s forward_backward took 9 s on 2 shared cores (1.1 s with this
# setting, 1.25 s with OMP_WAIT_POLICY=PASSIVE; idle, within a few % of the default).
OPENMP_SPIN_COUNT = "10000"


def configure_process(config: ServerConfig) -> None:
    """Logging, and libgomp's settings: read once, when torch loads it, so set before."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def serve(config: ServerConfig) -> None:
    configure_process(config)
    from treadle.server.app import create_app

    settings = uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # one line per poll would drown the log
        # the SDK holds long polls for up to 45 s; keep idle connections around for them
        timeout_keep_alive=75,
        # SIGTERM: stop accepting, give open requests (long polls) a few seconds, then drain
        # the engines (the lifespan's shutdown): what was acknowledged runs before the exit
        timeout_graceful_shutdown=5,
    )
    _Server(settings).run()


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM it handled (the engines drained, the state
    written) ends the process with status 0 rather than being raised again."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()
