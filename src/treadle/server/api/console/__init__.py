"""The web console at /console: server-rendered pages (Jinja2 + htmx, charts with uPlot)
and the JSON endpoints they poll, under /api/v1/treadle/console/ (documented for scripts).

    pages.py  the HTML pages          data.py  the JSON endpoints and log_metrics
    gate.py   login, the key cookie and static files    deps.py  who is looking
"""
