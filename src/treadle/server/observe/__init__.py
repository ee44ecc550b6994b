"""What an operator watches: Prometheus metrics (metrics, listener, the ASGI middleware in
http) and OpenTelemetry traces (tracing). Below every other layer of the API process: it
imports nothing of api, core or engines, and all of them may count into it."""
