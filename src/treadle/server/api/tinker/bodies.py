"""Reading a raw request body within the server's size limit, decompressed if it is zstd.

The limit holds for the bytes received and for the bytes a compressed body inflates to: a
small zstd body cannot turn into gigabytes, since decompression stops one byte past it.
"""

from __future__ import annotations

import asyncio
import io

from fastapi import Request

from treadle.errors import InvalidRequestError, PayloadTooLargeError


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
    if request.headers.get("content-encoding", "").lower() != "zstd":
        return body
    return await asyncio.to_thread(_unzstd, body, max_bytes)


def _unzstd(body: bytes, max_bytes: int) -> bytes:
    try:
        import zstandard
    except ImportError as e:
        raise InvalidRequestError("Content-Encoding: zstd is not supported here") from e
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            while chunk := reader.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLargeError(
                        f"body: decompresses to more than the limit of {max_bytes} bytes"
                    )
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise InvalidRequestError(f"body: Content-Encoding zstd but not zstd data ({e})") from e
    return b"".join(out)


def _too_large(size: int, max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"body: {size} bytes exceed the limit of {max_bytes} bytes per request; "
        "send smaller batches"
    )
