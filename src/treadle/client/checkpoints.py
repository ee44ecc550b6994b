"""Model package groups and their versions, from the SDK: `ServiceClient(...).checkpoints`.

svc = ServiceClient(model_package_group="math-sft", output_path="s3://bucket/runs")
tc = svc.create_lora_training_client("treadle/tiny-llama")
...
tc.save_weights_for_sampler("step-100", merge_weights=True).result()
for v in svc.checkpoints.list_versions("math-sft"):
    print(v.ref, v.kind, v.step, v.size_bytes)
svc.checkpoints.download("math-sft:latest", "exports/math-sft")
svc.checkpoints.set_retention("math-sft", keep_last=3, state_ttl_s=7 * 86400)
tc2 = svc.create_training_client_from_state_with_optimizer("math-sft:latest")
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from treadle.client.transport import Transport

PREFIX = "/api/v1/treadle/checkpoints"


class Version(BaseModel):
    """One registered version of a model package group."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    group: str
    version: int
    ref: str  # "GROUP:N": what create_training_client_from_state* and downloads take
    kind: str  # sampler (PEFT adapter) | merged (HF model folder) | state (adapter + Adam)
    name: str | None = None
    session_id: str | None = None
    model_id: str | None = None
    training_run_id: str | None = None
    base_model: str
    lora_config: dict[str, Any] | None = None
    step: int | None = None
    time: str
    size_bytes: int
    user_metadata: dict[str, Any] | None = None
    path: str  # where the files are stored (a server folder or s3://...)
    tinker_path: str | None = None
    encrypted: bool = False
    key_id: str | None = None
    source: str | None = None


class Group(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    versions: int
    latest: int | None = None
    size_bytes: int = 0
    keep_last: int | None = None
    state_ttl_s: float | None = None
    created_at: str


class CheckpointsClient:
    """Registry calls over the ServiceClient's connection (no session needed)."""

    def __init__(self, transport: Transport):
        self._transport = transport

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        async def go() -> Any:
            resp = await self._transport.request(method, PREFIX + path, **kw)
            return resp

        return self._transport.call(go())

    def list_groups(self) -> list[Group]:
        reply = self._call("GET", "/groups").json()
        return [Group.model_validate(g) for g in reply["groups"]]

    def list_versions(self, group: str, kind: str | None = None) -> list[Version]:
        """A group's versions, oldest first; `kind` filters (sampler | merged | state)."""
        path = f"/groups/{quote(group, safe='')}/versions" + (f"?kind={kind}" if kind else "")
        return [Version.model_validate(v) for v in self._call("GET", path).json()["versions"]]

    def get_version(self, ref: str) -> Version:
        """`GROUP:N` or `GROUP:latest`."""
        return Version.model_validate(self._call("GET", f"/versions/{quote(ref, safe='')}").json())

    def resolve(self, ref: str) -> str:
        """The tinker:// path of a version (what create_sampling_client takes)."""
        return str(self._call("GET", f"/versions/{quote(ref, safe='')}/resolve").json()["path"])

    def delete_version(self, ref: str) -> Version:
        reply = self._call("DELETE", f"/versions/{quote(ref, safe='')}").json()
        return Version.model_validate(reply)

    def set_retention(
        self, group: str, keep_last: int | None = None, state_ttl_s: float | None = None
    ) -> list[Version]:
        """Keep the last `keep_last` sampler versions (and merged ones) and delete training
        states older than `state_ttl_s`; applied now and after every new version.
        → the versions deleted now."""
        body = {"keep_last": keep_last, "state_ttl_s": state_ttl_s}
        reply = self._call("PUT", f"/groups/{quote(group, safe='')}/retention", json=body).json()
        return [Version.model_validate(v) for v in reply["deleted"]]

    def download(self, ref: str, dest: str | Path) -> Path:
        """The version's files (decrypted with the client's key) into folder `dest`:
        a PEFT adapter folder, an HF model folder, or a training state."""
        resp = self._call("GET", f"/versions/{quote(ref, safe='')}/archive", timeout=600)
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
            tar.extractall(out, filter="data")
        return out

    def import_adapter(
        self,
        folder: str | Path,
        group: str,
        base_model: str | None = None,
        name: str | None = None,
    ) -> Version:
        """Register a PEFT LoRA adapter folder made elsewhere as a version of `group`
        (base_model defaults to the adapter's base_model_name_or_path)."""
        src = Path(folder)
        if not src.is_dir():
            raise ValueError(f"folder: expected a PEFT adapter folder, got {str(src)!r}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(p for p in src.rglob("*") if p.is_file()):
                tar.add(path, arcname=path.relative_to(src).as_posix())
        params = {k: v for k, v in {"base_model": base_model, "name": name}.items() if v}
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
        path = f"/groups/{quote(group, safe='')}/import" + (f"?{query}" if query else "")
        reply = self._call("POST", path, content=buf.getvalue(), timeout=600).json()
        return Version.model_validate(reply)
