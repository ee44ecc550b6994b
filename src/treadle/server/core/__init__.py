"""Sessions, training models, samplers and futures: the server's state and its rules,
between the HTTP edge (api) and the engine handles (engines)."""
