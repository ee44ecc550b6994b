"""Custom losses uploaded with the tinker SDK's `ServiceClient.create_custom_loss` (alpha):
checked at the edge (treadle.engine.loss_graph_spec: an allow-list of ops, a DAG, bounded
size), kept as uploaded, and run by the engine inside the forward_backward that names them
(`loss_fn="custom"`, `loss_fn_config={"loss_id": ...}`): one engine call, no extra forward.

A loss belongs to the session that uploaded it: a forward_backward of another session (of
the same tenant or not) that names it gets the same 404 as an unknown id, and nothing reads
a loss back. An upload is answered by a future (the protocol's), finished the moment its
row is written; `(session_id, custom_loss_seq_id)` makes a resubmission get its loss back.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from sqlalchemy import select

from treadle.engine.loss_graph_spec import LossGraph, parse_graph, upload_text
from treadle.errors import InvalidRequestError, NotFoundError
from treadle.protocol.ops import CustomLossRef
from treadle.server.core.futures import Futures
from treadle.server.core.sessions import Sessions
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import insert_row
from treadle.server.storage.rows import CustomLossRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns

KIND = "create_custom_loss"  # the request kind of an upload's future


class CustomLosses:
    def __init__(self, store: Store, journal: Journal, sessions: Sessions, futures: Futures):
        self.store = store
        self.journal = journal
        self.sessions = sessions
        self.futures = futures
        self._rows: dict[str, tuple[CustomLossRow, LossGraph]] = {}

    async def create(
        self, tenant: Tenant, session_id: str, seq_id: int, name: str, inputs: list, graph: Any
    ) -> str:
        """Check and keep an upload; → the request_id of its (finished) future."""
        self.sessions.require(session_id)
        parsed = parse_graph(name, inputs, graph)  # 400 naming the op, the node, the limit
        existing = await asyncio.to_thread(self._by_seq, session_id, seq_id)
        loss_id = existing or new_id()
        if existing is None:
            values = {
                "loss_id": loss_id,
                "tenant_id": tenant.tenant_id,
                "session_id": session_id,
                "seq_id": seq_id,
                "name": parsed.name,
                "upload": upload_text(name, inputs, graph),
                "created_at": utcnow(),
            }
            await self.journal.run(functools.partial(insert_row, cls=CustomLossRow, values=values))
        result = json.dumps({"loss_id": loss_id, "type": KIND}).encode()
        return await self.futures.file_finished(
            tenant, KIND, result, session_id=session_id, dedup_key=f"{session_id}#loss#{seq_id}"
        )

    def _by_seq(self, session_id: str, seq_id: int) -> str | None:
        rows = self.store.query(
            select(CustomLossRow).where(
                (CustomLossRow.session_id == session_id) & (CustomLossRow.seq_id == seq_id)
            )
        )
        return rows[0].loss_id if rows else None

    async def ref(self, loss_id: Any, session_id: str) -> tuple[CustomLossRef, LossGraph]:
        """The loss a forward_backward of `session_id` names, as its op carries it."""
        if not isinstance(loss_id, str) or not loss_id:
            raise InvalidRequestError(
                "loss_fn_config['loss_id']: loss_fn 'custom' names the loss that "
                "create_custom_loss returned"
            )
        found = self._rows.get(loss_id)
        if found is None:
            row = await asyncio.to_thread(self.store.get, CustomLossRow, loss_id)
            if row is not None:
                found = self._rows[loss_id] = (row, _graph(row))
        if found is None or not owns(found[0].tenant_id) or found[0].session_id != session_id:
            raise NotFoundError(
                f"loss_fn_config['loss_id']: custom loss {loss_id!r} not found in this "
                "session (a loss is used by the session that created it)"
            )
        row, graph = found
        return CustomLossRef(row.loss_id, row.upload), graph


def _graph(row: CustomLossRow) -> LossGraph:
    upload = json.loads(row.upload)
    return parse_graph(upload["name"], upload["inputs"], upload["graph"])
