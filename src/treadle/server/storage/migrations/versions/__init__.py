"""The revisions, oldest first (Alembic reads every file here)."""
