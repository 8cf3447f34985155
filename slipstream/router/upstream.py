"""A small asyncio HTTP/1.1 client for the router's calls to its instances.

Built on h11 (uvicorn's own HTTP/1.1 parser, so `slipstream[serve]` brings
it): one connection per call, `Connection: close`, the body read as it comes
(an SSE stream chunk by chunk). Two failures are told apart, because the router
handles them differently:
  Unreachable   no connection could be made (refused, timed out): the request
                never reached the instance, so another instance may take it;
  UpstreamError the instance accepted the request and then failed (its
                connection closed, or it went silent past the read timeout):
                the request's own client gets an error.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11


class Unreachable(ConnectionError):
    """The instance could not be reached; the request was not sent."""


class UpstreamError(ConnectionError):
    """The instance failed after it had the request."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    _conn: h11.Connection
    _reader: asyncio.StreamReader
    _writer: asyncio.StreamWriter
    _read_timeout: float

    async def chunks(self):
        """The body, piece by piece as it arrives."""
        try:
            while True:
                event = await _next_event(self._conn, self._reader, self._read_timeout)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return
        finally:
            self.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def close(self) -> None:
        self._writer.close()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader, timeout: float):
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise UpstreamError(f"the connection broke off: {e}") from None
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await asyncio.wait_for(reader.read(65536), timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"no answer within {timeout:g} s") from None
        except OSError as e:
            raise UpstreamError(f"the connection failed: {e}") from None
        conn.receive_data(data)   # b"": the peer closed; h11 then says whether that was early


async def request(base_url: str, method: str, path: str, body: bytes = b"",
                  headers: dict[str, str] | None = None, connect_timeout: float = 3.0,
                  read_timeout: float = 600.0) -> Response:
    """Send one request; returns once the response's status and headers arrived."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise Unreachable(f"{base_url}: {type(e).__name__}: {e}") from None
    conn = h11.Connection(h11.CLIENT)
    head = [("Host", f"{host}:{port}"), ("Connection", "close"),
            ("Content-Length", str(len(body)))]
    head += [(k, v) for k, v in (headers or {}).items()
             if k.lower() not in ("host", "connection", "content-length", "transfer-encoding")]
    try:
        writer.write(conn.send(h11.Request(method=method, target=path, headers=head))
                     + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        while True:
            event = await _next_event(conn, reader, read_timeout)
            if isinstance(event, h11.Response):
                break
            if isinstance(event, h11.ConnectionClosed):
                raise UpstreamError("the connection closed before an answer")
    except OSError as e:
        writer.close()
        raise UpstreamError(f"the connection failed: {e}") from None
    except BaseException:
        writer.close()
        raise
    hdrs = {k.decode().lower(): v.decode() for k, v in event.headers}
    return Response(event.status_code, hdrs, conn, reader, writer, read_timeout)
