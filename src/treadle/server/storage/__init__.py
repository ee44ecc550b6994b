"""The database (rows, the Store, the hot-path statements) and artifacts (checkpoint
folders, object stores, encryption at rest)."""
