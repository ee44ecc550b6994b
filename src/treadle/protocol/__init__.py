"""What crosses between the API process and an engine worker: typed ops and outcomes, the
messages that carry them, the socket, engine faults, the flight recorder's file and the
settings a worker is started with. Both sides import this; it imports only the engine's
types and the error table."""
