"""OpenAI-compatible routes under /v1: chat completions, completions and the model list.

`model` names a base model, a live training model (its model_id: the session's current
weights), a saved checkpoint (tinker:// path), a registered version (GROUP:N) or a
sampling session id. Every request samples as asample does (the same queue, limits and
metering).
"""
