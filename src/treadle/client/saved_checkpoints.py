"""The tinker:// checkpoints of a tenant, from the SDK: `ServiceClient(...).saved`.

svc = ServiceClient()
for ckpt in svc.saved.search(checkpoint_type="sampler", user_metadata={"task": "math"}):
    print(ckpt.tinker_path, ckpt.time, ckpt.size_bytes)
svc.saved.set_ttl("tinker://<run>/weights/step-100", 7 * 86400)   # deleted in a week
svc.saved.publish("tinker://<run>/sampler_weights/final")          # every tenant may read it
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from treadle.types import Checkpoint
from treadle.wire.sdk_requests import CheckpointSearchRequest, CheckpointSearchResponse

if TYPE_CHECKING:
    from treadle.client.transport import Transport


class SavedCheckpoints:
    """Checkpoint search, TTL and publication over the ServiceClient's connection."""

    def __init__(self, transport: Transport):
        self._transport = transport

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        async def go() -> Any:
            return await self._transport.request(method, "/api/v1" + path, **kw)

        return self._transport.call(go())

    def search_page(self, **filters: Any) -> CheckpointSearchResponse:
        """One page, newest first: filters are CheckpointSearchRequest's (project_id,
        user_metadata, checkpoint_type, owner "own"|"accessible", base_model,
        training_run_id, limit, cursor)."""
        body = CheckpointSearchRequest(**filters).model_dump(mode="json", exclude_none=True)
        reply = self._call("POST", "/checkpoints/search", json=body)
        return CheckpointSearchResponse.model_validate(reply.json())

    def search(self, **filters: Any) -> Iterator[Checkpoint]:
        """Every match, newest first, page after page (the cursor handled here)."""
        while True:
            page = self.search_page(**filters)
            yield from page.checkpoints
            if page.next_cursor is None:
                return
            filters = {**filters, "cursor": page.next_cursor}

    def set_ttl(self, tinker_path: str, ttl_seconds: int | None) -> str | None:
        """Delete the checkpoint's files `ttl_seconds` from now (None: keep it); → when."""
        reply = self._call("PUT", _route(tinker_path, "ttl"), json={"ttl_seconds": ttl_seconds})
        return reply.json()["expires_at"]

    def publish(self, tinker_path: str, public: bool = True) -> None:
        """Make the checkpoint readable by every tenant of the server (False: yours again)."""
        self._call("POST" if public else "DELETE", _route(tinker_path, "publish"))


def _route(tinker_path: str, tail: str) -> str:
    run, _, rest = tinker_path.removeprefix("tinker://").partition("/")
    return f"/training_runs/{run}/checkpoints/{rest}/{tail}"
