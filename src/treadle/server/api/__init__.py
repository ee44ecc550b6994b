"""The HTTP edge: the Tinker routes and the OpenAI-compatible routes."""
