"""Request bodies within the server's size limits: one cap on every route, before anything
is parsed, and the raw bodies (protobuf, archives) read with zstd decompression capped too.

- `BodyLimit` (pure ASGI, on every route): a body over its route's limit is a 413 naming the
  limit, refused from its Content-Length or, when chunked, as it streams, so a large body
  is never held, let alone parsed (FastAPI parses JSON bodies on the event loop).
- `read_body` / `read_body_to_file`: the limit holds for the bytes received and for the bytes
  a compressed body inflates to: a small zstd body cannot turn into gigabytes, since
  decompression stops one byte past it.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fastapi import HTTPException, Request

from treadle.errors import InvalidRequestError, PayloadTooLargeError
from treadle.server.api.middleware import send_error
from treadle.server.config import InputLimits

# Bytes read from the socket are written to disk in blocks of about this size.
WRITE_BLOCK = 1 << 20
RAW_ROUTES = ("/api/v1/forward_backward",)  # protobuf bodies, read by read_body
IMPORT_ROUTE = ("/api/v1/treadle/checkpoints/groups/", "/import")  # a prefix, a suffix
UPLOAD_ROUTE = "/api/v1/treadle/uploads/"  # an external-weights file, by its signed URL


def limit_by_route(limits: InputLimits) -> Callable[[str], int]:
    """The body limit of each path: forward_backward's, the adapter import's, and the JSON
    limit of every other route."""

    def limit_of(path: str) -> int:
        if path in RAW_ROUTES:
            return limits.max_body_bytes
        if path.startswith(IMPORT_ROUTE[0]) and path.endswith(IMPORT_ROUTE[1]):
            return limits.max_import_bytes
        if path.startswith(UPLOAD_ROUTE):
            return limits.max_import_bytes
        return limits.max_json_body_bytes

    return limit_of


class BodyTooLarge(HTTPException):
    """Raised out of a route's receive channel; an HTTPException because FastAPI hands those
    on from its body parsing (any other error there becomes a 400)."""

    def __init__(self, error: PayloadTooLargeError):
        super().__init__(error.status, str(error), headers={"x-should-retry": "false"})
        self.error = error


class BodyLimit:
    """Pure ASGI middleware: refuse any request body over `limit_of(path)` bytes with a 413.

    A declared Content-Length over the limit is refused before a byte is read; a body without
    one is counted as it arrives and refused at the first chunk past the limit (the route's
    error handler answers it, or this middleware if it escapes).
    """

    def __init__(self, app: Any, limit_of: Callable[[str], int]):
        self.app = app
        self.limit_of = limit_of

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_of(scope["path"])
        declared = _content_length(scope["headers"])
        if declared is not None and declared > limit:
            await _send_413(send, _too_large(declared, limit), scope["path"])
            return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(_too_large(received, limit))
            return message

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge as e:
            if started:
                raise
            await _send_413(send, e.error, scope.get("path", ""))


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _send_413(send: Any, error: PayloadTooLargeError, path: str) -> None:
    retry = [(b"x-should-retry", b"false")]
    await send_error(send, error.status, str(error), path, error.category, retry)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        parts.append(chunk)
    body = b"".join(parts)
    if not _is_zstd(request):
        return body
    out = io.BytesIO()
    await asyncio.to_thread(_unzstd, io.BytesIO(body), out, max_bytes)
    return out.getvalue()


async def read_body_to_file(request: Request, path: Path, max_bytes: int) -> None:
    """The body, decompressed if it is zstd, streamed into `path` (never held in memory)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    raw = path.with_name(path.name + ".raw") if _is_zstd(request) else path
    size, block = 0, bytearray()
    with open(raw, "wb") as f:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            block += chunk
            if len(block) >= WRITE_BLOCK:
                await asyncio.to_thread(f.write, bytes(block))
                block.clear()
        await asyncio.to_thread(f.write, bytes(block))
    if raw != path:
        await asyncio.to_thread(_unzstd_file, raw, path, max_bytes)


def _is_zstd(request: Request) -> bool:
    return request.headers.get("content-encoding", "").lower() == "zstd"


def _unzstd_file(src: Path, dest: Path, max_bytes: int) -> None:
    try:
        with open(src, "rb") as f, open(dest, "wb") as out:
            _unzstd(f, out, max_bytes)
    finally:
        src.unlink(missing_ok=True)


def _unzstd(src: IO[bytes], out: IO[bytes], max_bytes: int) -> None:
    try:
        import zstandard
    except ImportError as e:
        raise InvalidRequestError("Content-Encoding: zstd is not supported here") from e
    size = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(src) as reader:
            while chunk := reader.read(WRITE_BLOCK):
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLargeError(
                        f"body: decompresses to more than the limit of {max_bytes} bytes"
                    )
                out.write(chunk)
    except zstandard.ZstdError as e:
        raise InvalidRequestError(f"body: Content-Encoding zstd but not zstd data ({e})") from e


def _too_large(size: int, max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"body: {size} bytes exceed the limit of {max_bytes} bytes per request; "
        "send smaller batches"
    )
