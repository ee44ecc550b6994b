"""Artifact stores against moto's S3 server (a real HTTP endpoint on a free port) and a local
folder: whole versions round-trip (encrypted or not), and a store that fails mid-way
registers nothing and leaves nothing behind.

    .venv/bin/python -m pytest -q tests/artifacts/test_s3_store.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _s3 import moto_s3

from treadle.artifacts import encryption, stores
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import PackageTarget
from treadle.server.registry import versions as registry
from treadle.server.storage.database import Store

boto3 = pytest.importorskip("boto3")

BUCKET = "units"


@pytest.fixture(scope="module")
def s3_url():
    with moto_s3(BUCKET) as url:
        yield url


def objects(s3_url: str) -> set[str]:
    s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    return {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_model.safetensors").write_bytes(b'{"__metadata__":{}}' + bytes(range(256)) * 50)
    (src / "adapter_config.json").write_text('{"r": 4}')
    (src / "sub" / "empty.txt").write_bytes(b"")
    return src


def same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(
        p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != stores.MANIFEST
    ) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.parametrize("encrypted", [False, True])
def test_s3_round_trip(s3_url, folder, tmp_path, encrypted):
    key = encryption.parse_key(encryption.new_key()) if encrypted else None
    prefix = f"rt-{int(encrypted)}"
    store = stores.S3Store(f"s3://{BUCKET}/{prefix}")
    manifest = store.put_files(folder, key)
    assert manifest["encrypted"] == encrypted and len(manifest["files"]) == 3
    raw = (
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
        .get_object(Bucket=BUCKET, Key=f"{prefix}/adapter_model.safetensors")["Body"]
        .read()
    )
    assert raw.startswith(b"TRDLENC1") == encrypted and (b"__metadata__" in raw) != encrypted

    stores.S3Store(store.url).get_files(tmp_path / "back", key)
    assert same_files(folder, tmp_path / "back")
    if encrypted:
        with pytest.raises(InvalidRequestError, match="encrypted"):
            stores.S3Store(store.url).get_files(tmp_path / "nokey", None)
        with pytest.raises(InvalidRequestError, match="wrong key"):
            wrong = encryption.parse_key(encryption.new_key())
            stores.S3Store(store.url).get_files(tmp_path / "wrong", wrong)
    store.delete_all()
    assert not [k for k in objects(s3_url) if k.startswith(prefix + "/")]


class FailingS3Store(stores.S3Store):
    """The real S3 store, whose second upload fails (a dropped connection mid-version)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.uploads = 0

    def put_object(self, name: str, src: Path) -> None:
        self.uploads += 1
        if self.uploads == 2:
            raise OSError("connection reset by peer")
        super().put_object(name, src)


class FailingLocalStore(stores.LocalStore):
    def __init__(self, url: str):
        super().__init__(url)
        self.copies = 0

    def put_object(self, name: str, src: Path) -> None:
        self.copies += 1
        if self.copies == 2:
            raise OSError("no space left on device")
        super().put_object(name, src)


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_a_failed_upload_registers_nothing(s3_url, folder, tmp_path, monkeypatch, kind):
    db = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    root = f"s3://{BUCKET}/fail" if kind == "s3" else str(tmp_path / "packages")
    pkg = PackageTarget("t1", "g", root, "m", {})
    failing = FailingS3Store if kind == "s3" else FailingLocalStore
    made = []
    monkeypatch.setattr(stores, "open_location", lambda url: made.append(failing(url)) or made[-1])

    with pytest.raises(OSError):
        registry.publish(db, pkg, "sampler", folder)
    assert made[0].uploads if kind == "s3" else made[0].copies  # it did start uploading
    with pytest.raises(Exception, match="not found"):
        registry.list_versions(db, "t1", "g")
    if kind == "s3":
        assert not [k for k in objects(s3_url) if k.startswith("fail/")]
    else:
        assert not list((tmp_path / "packages").rglob("*.safetensors"))

    # the same publish with a working store registers version 1, complete
    monkeypatch.undo()
    row = registry.publish(db, pkg, "sampler", folder)
    assert row.version == 1 and row.size_bytes == sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file()
    )
    stores.open_location(row.location).get_files(tmp_path / "ok")
    assert same_files(folder, tmp_path / "ok")
    db.close()
