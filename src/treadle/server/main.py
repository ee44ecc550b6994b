"""Run the server: `treadle serve` parses its flags into a ServerConfig and calls serve();
`treadle worker` configures its process the same way.

How it ends: a start-up that cannot succeed (a port in use, a model that cannot load) ends
with one line on stderr that says why and what to do, and exit status 1. SIGTERM or Ctrl-C
drains (the drain timeout bounds it) and exits 0, also while the workers are still starting;
a second one ends the process at once (its workers die with it).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from types import FrameType

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
    if (in_use := port_in_use(config.host, config.port)) is not None:
        sys.exit(f"treadle serve: {in_use}")
    from treadle.server.app import create_app

    app = create_app(config)
    settings = uvicorn.Config(
        app,
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

    # a failed or stopped start-up is said once, below, not as uvicorn's traceback of it
    def quiet(record: logging.LogRecord) -> bool:
        ended = app.state.cannot_start is not None or (
            app.state.stopping.is_set() and not hasattr(app.state, "server")
        )
        return not (ended and record.levelno >= logging.ERROR)

    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        _Server(settings).run()
    except SystemExit:
        if app.state.cannot_start is not None:
            sys.exit(f"treadle serve: {app.state.cannot_start}")
        if not app.state.stopping.is_set():
            raise
    finally:
        exit_quickly()
    if app.state.stopping.is_set() and not hasattr(app.state, "server"):
        print("treadle serve: stopped before it started serving", file=sys.stderr)


def exit_quickly() -> None:
    """Everything is written and closed: the interpreter's last garbage collections, over
    every object of torch and transformers, would take seconds (more on a busy machine)
    and free nothing the exit does not."""
    gc.freeze()


def port_in_use(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (as uvicorn will), or None: said before
    anything loads, rather than after."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is in use (another treadle serve?); stop what "
                    "holds it, or pick another one with --port"
                )
            return f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port"
    return None


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM it handled (the engines drained, the state
    written) ends the process with status 0 rather than being raised again; a signal while
    the app starts ends its start-up (app.state.stopping); a second signal ends the process
    at once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second one: no drain, no wait
            name = signal.Signals(sig).name
            os.write(
                2, f"treadle serve: {name} again: stopping at once, without draining\n".encode()
            )
            os._exit(128 + sig)
        super().handle_exit(sig, frame)
        self.config.app.state.stopping.set()
