"""What the app adds when the console is on (ServerConfig.console): its routes, pages,
login gate and static files when the app is built, its recorder (an outcome listener,
treadle.server.core.listeners) and its views when the server starts.

    add_console(app)                          # create_app, after the app's own middleware
    console = Console(config, journal)        # the lifespan; console.recorder is a listener
    console.start(app, store, engines, spend); ... console.stop()

The loop's own metrics (POST /api/v1/treadle/metrics) are the SDK's call, not the console's:
the app mounts that route whether or not the console is on (`metrics_router`).
"""

from __future__ import annotations

from fastapi import FastAPI

from treadle.server.config import ServerConfig
from treadle.server.console import pages, routes
from treadle.server.console.gate import ConsoleGate
from treadle.server.console.recorder import Recorder
from treadle.server.console.views import ConsoleViews
from treadle.server.engines.served import Engines
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.tenancy.spend import SpendBook

metrics_router = routes.metrics_router


def add_console(app: FastAPI) -> None:
    """The console's JSON endpoints and pages, and its gate: added last, so outermost (it
    hands the login cookie's key to the API's own authentication)."""
    for router in (routes.router, pages.router):
        app.include_router(router)
    app.state.console_templates = pages.make_templates()
    app.add_middleware(ConsoleGate)


class Console:
    """The console's running parts: the recorder, and the views its routes read."""

    def __init__(self, config: ServerConfig, journal: Journal):
        self.config = config
        self.recorder = Recorder(journal)

    def start(self, app: FastAPI, store: Store, engines: Engines, spend: SpendBook) -> None:
        app.state.console = ConsoleViews(self.config, store, engines, self.recorder, spend)
        self.recorder.start()

    def stop(self) -> None:
        """Write the last figures (before the journal stops)."""
        self.recorder.stop()
