"""Run the server: `treadle serve` parses its flags into a ServerConfig and calls serve()."""

from __future__ import annotations

import logging

import uvicorn

from treadle.server.app import create_app
from treadle.server.config import ServerConfig


def serve(config: ServerConfig) -> None:
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
