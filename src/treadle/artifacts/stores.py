"""Where versions' files live: a local folder, or an S3-compatible object store (boto3).

A version is a set of files under one location (a folder, or `s3://bucket/prefix/...`),
written by `put_files` and read back by `get_files`, optionally encrypted per file
(treadle.artifacts.encryption). Each location ends with `manifest.json`, written last: a
location without it was never finished.

S3 settings come from the environment, like any boto3 program: credentials
(AWS_ACCESS_KEY_ID, ...), AWS_DEFAULT_REGION, and the endpoint of a non-AWS store (MinIO,
Ceph, ...) in TREADLE_S3_ENDPOINT_URL (or boto3's own AWS_ENDPOINT_URL_S3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treadle.artifacts import encryption
from treadle.errors import InvalidRequestError, NotFoundError

MANIFEST = "manifest.json"
READ_CHUNK = 1 << 20


class ArtifactStore:
    """One location: the files of one version."""

    url: str

    def put_object(self, name: str, src: Path) -> None:
        raise NotImplementedError

    def get_object(self, name: str, dest: Path) -> None:
        raise NotImplementedError

    def read_object(self, name: str) -> bytes:
        raise NotImplementedError

    def delete_all(self) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        """Called after every file is written: make the location visible under its name."""

    def local_dir(self) -> Path | None:
        """The folder holding the files as they are, when there is one (local stores)."""
        return None

    # ---- whole versions ----
    def put_files(self, src_dir: Path, key: bytes | None = None) -> dict[str, Any]:
        """Store every file under src_dir (encrypted with `key` if given), manifest last;
        → the manifest. On any failure, what was written is deleted and the error raised."""
        files: dict[str, dict[str, Any]] = {}
        scratch = src_dir.parent / f".enc-{uuid.uuid4().hex[:8]}"
        try:
            for path in sorted(p for p in src_dir.rglob("*") if p.is_file()):
                name = path.relative_to(src_dir).as_posix()
                digest, size = _sha256(path)
                source = path
                if key is not None:
                    scratch.mkdir(exist_ok=True)
                    source = scratch / uuid.uuid4().hex
                    with open(path, "rb") as fin, open(source, "wb") as fout:
                        for block in encryption.encrypt_stream(key, name, _chunks(fin)):
                            fout.write(block)
                self.put_object(name, source)
                if key is not None:
                    source.unlink()
                files[name] = {"size": size, "sha256": digest}
            manifest = {
                "format": 1,
                "files": files,
                "encrypted": key is not None,
                "key_id": encryption.key_id(key) if key is not None else None,
            }
            scratch.mkdir(exist_ok=True)
            manifest_file = scratch / MANIFEST
            manifest_file.write_text(json.dumps(manifest, indent=2))
            self.put_object(MANIFEST, manifest_file)
            self.commit()
            return manifest
        except BaseException:
            try:
                self.delete_all()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def manifest(self) -> dict[str, Any]:
        try:
            return json.loads(self.read_object(MANIFEST))
        except FileNotFoundError as e:
            raise NotFoundError(f"{self.url}: no {MANIFEST} (an unfinished write)") from e

    def get_files(self, dest: Path, key: bytes | None = None) -> dict[str, Any]:
        """Copy every file of the version into dest (decrypted), checking sizes and hashes."""
        manifest = self.manifest()
        if manifest["encrypted"]:
            if key is None:
                raise InvalidRequestError(
                    f"{encryption.HEADER}: this version is encrypted; send its key "
                    f"(key id {manifest['key_id']})"
                )
            if encryption.key_id(key) != manifest["key_id"]:
                raise InvalidRequestError(
                    f"{encryption.HEADER}: wrong key for this version (its key id is "
                    f"{manifest['key_id']}, the key sent has id {encryption.key_id(key)})"
                )
        dest.mkdir(parents=True, exist_ok=True)
        for name, meta in manifest["files"].items():
            target = dest / name
            if not target.resolve().is_relative_to(dest.resolve()):
                raise InvalidRequestError(f"{self.url}: unsafe file name {name!r} in manifest")
            target.parent.mkdir(parents=True, exist_ok=True)
            if manifest["encrypted"]:
                raw = target.with_name(target.name + ".enc")
                self.get_object(name, raw)
                with open(raw, "rb") as fin, open(target, "wb") as fout:
                    for block in encryption.decrypt_stream(key, name, _chunks(fin)):
                        fout.write(block)
                raw.unlink()
            else:
                self.get_object(name, target)
            digest, size = _sha256(target)
            if size != meta["size"] or digest != meta["sha256"]:
                raise InvalidRequestError(
                    f"{self.url}/{name}: stored file does not match its manifest "
                    f"(size {size} vs {meta['size']})"
                )
        return manifest


def _chunks(f: Any) -> Iterator[bytes]:
    while block := f.read(READ_CHUNK):
        yield block


def _sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in _chunks(f):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


class LocalStore(ArtifactStore):
    """A folder; files are written into a `.tmp-*` sibling renamed into place by commit()."""

    def __init__(self, folder: str | Path):
        self.final = Path(folder).resolve()
        self.url = str(self.final)
        self.tmp = self.final.parent / f".tmp-{self.final.name}-{uuid.uuid4().hex[:8]}"

    def put_object(self, name: str, src: Path) -> None:
        target = self.tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)

    def commit(self) -> None:
        if self.final.exists():
            raise InvalidRequestError(f"{self.url}: already exists")
        self.tmp.rename(self.final)

    def get_object(self, name: str, dest: Path) -> None:
        shutil.copyfile(self.final / name, dest)

    def read_object(self, name: str) -> bytes:
        return (self.final / name).read_bytes()

    def delete_all(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.final, ignore_errors=True)

    def local_dir(self) -> Path | None:
        return self.final


class S3Store(ArtifactStore):
    """`s3://bucket/prefix`: objects `prefix/<file name>`. There is no rename in S3, so the
    files go straight under their final prefix (a fresh one nobody refers to yet) and the
    manifest last; the version is registered only after that."""

    def __init__(self, url: str, client: Any = None):
        if not url.startswith("s3://"):
            raise InvalidRequestError(f"output_path: expected s3://bucket/prefix, got {url!r}")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise InvalidRequestError(f"output_path: no bucket in {url!r}")
        self.url = url.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client or s3_client()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def put_object(self, name: str, src: Path) -> None:
        _retrying(self.client.upload_file, str(src), self.bucket, self._key(name))

    def get_object(self, name: str, dest: Path) -> None:
        _retrying(self.client.download_file, self.bucket, self._key(name), str(dest))

    def read_object(self, name: str) -> bytes:
        try:
            resp = _retrying(self.client.get_object, Bucket=self.bucket, Key=self._key(name))
        except Exception as e:
            if _is_missing(e):
                raise FileNotFoundError(self._key(name)) from e
            raise
        return resp["Body"].read()

    def delete_all(self) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


def _is_missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in ("NoSuchKey", "404", "NotFound")


def _retrying(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Retry transient S3 failures (throttling, 5xx, dropped connections) a few times;
    s3transfer retries inside a transfer too, this covers the calls around it."""
    import tenacity
    from botocore.exceptions import ClientError, ConnectionError, EndpointConnectionError

    def transient(exc: BaseException) -> bool:
        if isinstance(exc, ConnectionError | EndpointConnectionError):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return status >= 500 or status == 429
        return False

    retry = tenacity.Retrying(
        retry=tenacity.retry_if_exception(transient),
        stop=tenacity.stop_after_attempt(4),
        wait=tenacity.wait_exponential(multiplier=0.2, max=3),
        reraise=True,
    )
    return retry(fn, *args, **kwargs)


def s3_client() -> Any:
    try:
        import boto3
    except ImportError as e:
        raise InvalidRequestError(
            "output_path: s3:// stores need boto3 on the server (pip install 'treadle[s3]')"
        ) from e
    endpoint = os.environ.get("TREADLE_S3_ENDPOINT_URL") or None
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
    return boto3.client("s3", endpoint_url=endpoint, region_name=region)


def open_location(url: str) -> ArtifactStore:
    """The store of a version location: `s3://...` or a local folder."""
    if url.startswith("s3://"):
        return S3Store(url)
    return LocalStore(url)


def check_output_path(value: str | None, field: str = "output_path") -> str | None:
    """An output root: s3://bucket[/prefix] or an absolute folder on the server."""
    if value is None:
        return None
    if value.startswith("s3://"):
        if not value.removeprefix("s3://").split("/")[0]:
            raise InvalidRequestError(f"{field}: expected s3://bucket/prefix, got {value!r}")
        return value.rstrip("/")
    if "://" in value or not Path(value).is_absolute():
        raise InvalidRequestError(
            f"{field}: expected s3://bucket/prefix or an absolute folder path on the server, "
            f"got {value!r}"
        )
    return str(Path(value))


def join(root: str, *parts: str) -> str:
    if root.startswith("s3://"):
        return "/".join([root.rstrip("/"), *parts])
    return str(Path(root, *parts))
