"""Raw HTTP/1.1 forwarding for the fault-injecting test proxy (tests/client/_proxy.py): one
request on a fresh upstream connection, content-length bodies only."""

from __future__ import annotations

import asyncio


async def forward_once(upstream: tuple[str, int], head: bytes, body: bytes) -> bytes:
    """Send one request upstream on a new connection; → the raw response."""
    up_reader, up_writer = await asyncio.open_connection(*upstream)
    try:
        up_writer.write(head + body)
        await up_writer.drain()
        resp_head = await up_reader.readuntil(b"\r\n\r\n")
        resp_body = await up_reader.readexactly(content_length(resp_head))
        return resp_head + resp_body
    finally:
        up_writer.close()


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            raise NotImplementedError("the test proxies handle content-length bodies only")
    return 0
