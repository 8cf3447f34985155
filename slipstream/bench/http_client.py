"""A minimal HTTP/1.1 client over asyncio streams (standard library only), enough for
benchmarks and tests to stream server-sent events and to hang up mid-response.

One connection per request (`Connection: close`); chunked and sized bodies.
"""
from __future__ import annotations

import asyncio
import json
from urllib.parse import urlparse


async def open_request(url, method: str, path: str, body: dict | None, api_key: str | None):
    """Open a request; returns (status, reader, writer, headers) with the body unread."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}", "Connection: close",
            "Content-Type: application/json", f"Content-Length: {len(data)}"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, reader, writer, headers


async def body_chunks(reader, headers):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def get_json(url: str, path: str, api_key: str | None) -> dict:
    status, reader, writer, headers = await open_request(url, "GET", path, None, api_key)
    body = b"".join([c async for c in body_chunks(reader, headers)])
    writer.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: {status} {body[:200]!r}")
    return json.loads(body)
