"""The web console, an optional slice of the server (ServerConfig.console, `--console`):
server-rendered pages (Jinja2 + htmx, charts with uPlot), the JSON endpoints they poll under
/api/v1/treadle/console/ (documented for scripts), and the recorder that feeds them. The app
wires it (treadle.server.console.wiring); nothing else of the server imports it.

    wiring.py    what the app adds when the console is on
    recorder.py  the outcome listener: op timeline, step figures, live engine figures
    views.py, views_base.py, sessions.py   the read model of the pages and JSON
    figures.py   step figures (the server's and log_metrics')   timeline.py  ops over time
    routes.py    the JSON endpoints, and log_metrics (mounted with the console off too)
    pages.py     the HTML pages   gate.py  login, the key cookie, static files
    deps.py      who is looking
"""
