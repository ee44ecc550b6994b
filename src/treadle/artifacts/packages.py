"""The files of a model package version: stored first, complete before anyone registers them.

`store_version` puts a folder's files under a new location of the group (a server folder or
`s3://...`, encrypted with the tenant's key when one is given; treadle.artifacts.stores)
and returns the VersionRecord that the API then numbers and registers
(treadle.server.registry.versions). A failed store leaves nothing behind and registers
nothing. Engine workers call it for a save of a model bound to a group; the API for an
imported adapter.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from treadle.artifacts import stores
from treadle.protocol.ops import PackageTarget
from treadle.protocol.saved import VersionRecord


def store_version(
    pkg: PackageTarget,
    kind: str,
    src_dir: Path,
    *,
    name: str | None = None,
    tinker_path: str | None = None,
    step: int | None = None,
    user_metadata: dict | None = None,
    source: str | None = None,
    store: stores.ArtifactStore | None = None,
) -> VersionRecord:
    """Store src_dir's files as a new version of pkg's group; → its record (unnumbered)."""
    location = stores.join(pkg.output_root, pkg.tenant_id, pkg.group, uuid.uuid4().hex)
    target = store or stores.open_location(location)
    manifest = target.put_files(Path(src_dir), pkg.key)
    return VersionRecord(
        tenant_id=pkg.tenant_id,
        group_name=pkg.group,
        kind=kind,
        location=target.url,
        size_bytes=sum(f["size"] for f in manifest["files"].values()),
        encrypted=manifest["encrypted"],
        key_id=manifest["key_id"],
        base_model=pkg.base_model,
        lora_config=pkg.lora_config,
        name=name,
        session_id=pkg.session_id,
        model_id=pkg.model_id,
        run_id=pkg.run_id,
        step=step,
        user_metadata=user_metadata,
        tinker_path=tinker_path,
        source=source,
    )


def discard_version(record: VersionRecord) -> None:
    """Delete a stored version's files (its registration failed)."""
    stores.open_location(record.location).delete_all()
