"""The engine side of the server: typed ops, the scheduler, the engine loop, the executor,
checkpoint writing and the journal. Nothing here speaks HTTP."""
