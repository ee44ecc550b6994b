"""Which model package group a training model publishes its saves to.

A model created with `model_package_group` (and optionally `output_path`) is bound once;
every save of it then asks where to publish (the sampler refresh of every RL step does), so
the bindings of this server are kept in memory, by the Bindings object its app owns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.artifacts import stores
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import PackageTarget
from treadle.server.registry.names import check_group
from treadle.server.storage.database import Store
from treadle.server.storage.rows import ModelPackageRow

MAX_CACHED = 100_000


def check_binding(group: str | None, output_path: str | None, single_user: bool) -> None:
    """Validate create-time arguments before anything is made.

    A server folder as output_path is for single-user servers: a tenant of a shared server
    must not make it write wherever its process may, so tenants get s3:// or the default.
    """
    if group is None:
        if output_path is not None:
            raise InvalidRequestError("output_path: only meaningful with model_package_group")
        return
    check_group(group)
    root = stores.check_output_path(output_path)
    if root is not None and not root.startswith("s3://") and not single_user:
        raise InvalidRequestError(
            "output_path: a server folder is only allowed on a single-user server; a tenant "
            f"may give s3://bucket/prefix or leave it unset, got {output_path!r}"
        )


class Bindings:
    def __init__(self, store: Store, packages_root: Path):
        self.store = store
        self.packages_root = packages_root
        self._cache: dict[str, ModelPackageRow | None] = {}  # model_id → binding or None

    def bind(self, model_id: str, tenant_id: str, group: str, output_path: str | None) -> None:
        check_group(group)
        output_path = stores.check_output_path(output_path)
        row = ModelPackageRow(
            model_id=model_id, tenant_id=tenant_id, group_name=group, output_path=output_path
        )
        with self.store.session.begin() as s:
            s.merge(row)
        self._remember(model_id, row)

    def get(self, model_id: str) -> ModelPackageRow | None:
        if model_id in self._cache:
            return self._cache[model_id]
        row = self.store.get(ModelPackageRow, model_id)
        self._remember(model_id, row)
        return row

    def target(self, model: Any, key: bytes | None) -> PackageTarget | None:
        """Where a save of `model` (a ModelRow) publishes (None: it has no group)."""
        bound = self.get(model.model_id)
        if bound is None:
            return None
        return PackageTarget(
            tenant_id=bound.tenant_id,
            group=bound.group_name,
            output_root=bound.output_path or str(self.packages_root),
            base_model=model.base_model,
            lora_config=model.lora_config,
            key=key,
            session_id=model.session_id,
            model_id=model.model_id,
            run_id=model.run_id,
        )

    def _remember(self, model_id: str, row: ModelPackageRow | None) -> None:
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[model_id] = row
