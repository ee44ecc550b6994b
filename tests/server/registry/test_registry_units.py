"""Units of the model package registry: version references, the retention policy, the
encrypted file format, and tenant scoping of queries (rows of two tenant ids in one
database).

    .venv/bin/python -m pytest -q tests/server/registry/test_registry_units.py
"""

from __future__ import annotations

import base64
import datetime as dt
import os
from types import SimpleNamespace

import pytest

from treadle.artifacts import encryption
from treadle.errors import InvalidRequestError, NotFoundError
from treadle.protocol.ops import PackageTarget
from treadle.server.registry import names, sources
from treadle.server.registry import versions as registry
from treadle.server.storage.database import Store


def test_version_references():
    assert names.parse_ref("math-sft:7") == ("math-sft", 7)
    assert names.parse_ref("g.v2_x:latest") == ("g.v2_x", None)
    # the server tells references from paths (the SDK sends either as model_path)
    assert names.is_ref("math-sft:3") and names.is_ref("math-sft:latest")
    for path in ("tinker://run/sampler_weights/x", "/abs/folder", "g:abc", "a/b:1"):
        assert not names.is_ref(path)
    for bad in ("tinker://run/weights/x", "s3://b/k", "g", "g:", "g:x", ":1", "a:b:1", "g h:1"):
        assert not names.is_ref(bad)
        with pytest.raises(InvalidRequestError, match="GROUP:N"):
            names.parse_ref(bad)
    with pytest.raises(InvalidRequestError, match="model_package_group"):
        names.check_group("has space")


def v(version: int, kind: str, age_s: float, now: dt.datetime) -> SimpleNamespace:
    return SimpleNamespace(version=version, kind=kind, created_at=now - dt.timedelta(seconds=age_s))


def test_retention_policy_picks_exactly_the_expired_versions():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [
        v(1, "sampler", 500, now),
        v(2, "merged", 490, now),
        v(3, "state", 480, now),
        v(4, "sampler", 300, now),
        v(5, "sampler", 200, now),
        v(6, "state", 100, now),
        v(7, "merged", 50, now),
        v(8, "sampler", 10, now),
    ]
    pick = lambda k, ttl: [r.version for r in registry.expired_versions(rows, k, ttl, now)]  # noqa: E731
    assert pick(None, None) == []
    assert pick(2, None) == [1, 4]  # samplers 1,4,5,8 keep 5,8; merged 2,7 both stay
    assert pick(1, None) == [1, 2, 4, 5]
    assert pick(None, 200) == [3]  # the state 480 s old; the 100 s one stays
    assert pick(3, 50) == [1, 3, 6]
    assert pick(10, 1000) == []


def test_queries_are_scoped_by_tenant(tmp_path):
    db = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"weights")
    for tenant in ("t-a", "t-b", "t-a"):
        pkg = PackageTarget(tenant, "shared-name", str(tmp_path / "packages"), "m", {})
        registry.publish(db, pkg, "sampler", src)
    a = registry.list_versions(db, "t-a", "shared-name")
    b = registry.list_versions(db, "t-b", "shared-name")
    assert [r.version for r in a] == [1, 2] and [r.version for r in b] == [1]
    assert {r.tenant_id for r in a} == {"t-a"} and "/t-a/" in a[0].location
    assert registry.get_version(db, "t-b", "shared-name:latest").id == b[0].id
    with pytest.raises(NotFoundError):
        registry.get_version(db, "t-b", "shared-name:2")
    with pytest.raises(NotFoundError):
        registry.list_versions(db, "t-c", "shared-name")
    registry.set_retention(db, "t-a", "shared-name", keep_last=1)
    assert [r.version for r in registry.list_versions(db, "t-a", "shared-name")] == [2]
    assert len(registry.list_versions(db, "t-b", "shared-name")) == 1
    db.close()


def test_keys_parse_from_base64_or_hex():
    raw = os.urandom(32)
    for text in (
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
    ):
        assert encryption.parse_key(text) == raw
    assert encryption.parse_key(None) is None
    with pytest.raises(InvalidRequestError, match="32-byte"):
        encryption.parse_key(base64.b64encode(os.urandom(16)).decode())
    assert encryption.key_id(raw) != encryption.key_id(os.urandom(32))


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 350])
def test_encrypted_format_round_trips_and_detects_tampering(monkeypatch, size):
    monkeypatch.setattr(encryption, "CHUNK", 100)  # several chunks from small data
    key, data = os.urandom(32), os.urandom(size)
    blob = encryption.encrypt_bytes(key, "f.bin", data)
    assert blob.startswith(encryption.MAGIC) and (size < 16 or data not in blob)
    pieces = [blob[i : i + 37] for i in range(0, len(blob), 37)]  # any read sizes
    assert b"".join(encryption.decrypt_stream(key, "f.bin", pieces)) == data
    with pytest.raises(InvalidRequestError, match="wrong encryption key"):
        encryption.decrypt_bytes(os.urandom(32), "f.bin", blob)
    with pytest.raises(InvalidRequestError):  # bound to its file name
        encryption.decrypt_bytes(key, "other.bin", blob)
    header = len(encryption.MAGIC) + encryption.PREFIX
    chunks = max(1, -(-size // 100))
    if chunks > 1:  # dropping the last chunk is noticed, not a shorter plaintext
        cut = header + (chunks - 1) * (100 + encryption.TAG)
        with pytest.raises(InvalidRequestError):
            encryption.decrypt_bytes(key, "f.bin", blob[:cut])
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with pytest.raises(InvalidRequestError):
        encryption.decrypt_bytes(key, "f.bin", bytes(flipped))
    with pytest.raises(InvalidRequestError, match="not an encrypted"):
        encryption.decrypt_bytes(key, "f.bin", b"plain bytes, no header at all")


def test_an_overwritten_tinker_path_belongs_to_its_newest_version(tmp_path):
    from treadle.server.storage.rows import CheckpointRow, utcnow

    db = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    src, work = tmp_path / "adapter", tmp_path / "artifacts" / "run" / "weights" / "latest"
    src.mkdir()
    work.mkdir(parents=True)
    (src / "adapter_model.safetensors").write_bytes(b"weights")
    path = "tinker://run/weights/latest"
    pkg = PackageTarget("t", "g", str(tmp_path / "p"), "m", {})
    old = registry.publish(db, pkg, "state", src, tinker_path=path)
    new = registry.publish(db, pkg, "state", src, tinker_path=path)  # save_state(overwrite)
    db.add(
        CheckpointRow(
            tinker_path=path,
            run_id="run",
            model_id="m:train:0",
            checkpoint_type="training",
            name="latest",
            dir=str(work),
            base_model="m",
            lora_config={},
            created_at=utcnow(),
        )
    )
    assert sources.resolve_version(db, "t", "g:1") == old.location  # not the overwritten path
    assert sources.resolve_version(db, "t", "g:2") == path
    registry.delete_version(db, "t", "g:1")
    assert db.get(CheckpointRow, path) is not None and work.is_dir()  # version 2 still uses it
    registry.delete_version(db, "t", "g:2")
    assert db.get(CheckpointRow, path) is None and not work.exists()
    assert not os.path.exists(old.location) and not os.path.exists(new.location)
    db.close()
