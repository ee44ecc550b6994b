"""Capture sessions on the API side: the request headers that put a /v1 or /v1/messages
completion under one, the recorded sampling, and the SDK's routes
(treadle.server.core.captures holds the records)."""
