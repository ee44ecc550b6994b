"""Checkpoint files: folders under the data directory, artifact stores (a folder or S3) and
their encryption. Both the API and the engine workers write and read them; nothing here
touches the database."""
