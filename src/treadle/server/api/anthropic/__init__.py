"""Anthropic's Messages API, POST /v1/messages, on the /v1 routes' machinery: the same
model names, tenancy, prompt rendering, sampling queue and metering."""
