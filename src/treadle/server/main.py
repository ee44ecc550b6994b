"""Run the server: `treadle serve` parses its flags into a ServerConfig and calls serve()."""

from __future__ import annotations

import logging
import os

import uvicorn

from treadle.server.config import ServerConfig

# How long (in spin iterations: a fraction of a millisecond) an idle OpenMP thread busy-waits
# before it sleeps. libgomp's default (300000, a few ms) is harmless on a machine of its own
# but ruinous when the cores are shared with another busy process (the user's own loop on
# the same box, another job): the team's threads burn whole time slices spinning at every
# barrier, and a 0.45 s forward_backward took 9 s on 2 shared cores (1.1 s with this
# setting, 1.25 s with OMP_WAIT_POLICY=PASSIVE; idle, within a few % of the default).
OPENMP_SPIN_COUNT = "10000"


def serve(config: ServerConfig) -> None:
    # libgomp reads its settings once, when torch loads it: set them before importing the app.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    from treadle.server.app import create_app

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # one line per poll would drown the log
        # the SDK holds long polls for up to 45 s; keep idle connections around for them
        timeout_keep_alive=75,
    )
