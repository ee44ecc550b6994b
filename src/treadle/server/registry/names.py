"""Names of model package groups and references to their versions (`GROUP:N`, `GROUP:latest`)."""

from __future__ import annotations

import re

from treadle.errors import InvalidRequestError

_GROUP = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_group(name: str | None, field: str = "model_package_group") -> str:
    if not name or not _GROUP.match(name):
        raise InvalidRequestError(
            f"{field}: expected 1-64 characters of letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit), got {name!r}"
        )
    return name


def is_ref(text: str) -> bool:
    """`GROUP:N` / `GROUP:latest` (a tinker:// path or an s3:// URL is not a reference)."""
    if "://" in text or text.count(":") != 1:
        return False
    group, version = text.split(":")
    return bool(_GROUP.match(group)) and (version == "latest" or version.isdigit())


def parse_ref(ref: str, field: str = "version") -> tuple[str, int | None]:
    """→ (group, version number or None for latest)."""
    if not is_ref(ref):
        raise InvalidRequestError(f"{field}: expected GROUP:N or GROUP:latest, got {ref!r}")
    group, version = ref.split(":")
    return group, None if version == "latest" else int(version)
