"""Load: 64 concurrent streaming clients send 256 requests; each gets exactly its tokens, and
afterwards the KV pool is fully free. Then the same with a third of the clients hanging up
mid-stream: their requests are aborted and their blocks come back."""
from __future__ import annotations

import asyncio
import json
import random
import time

from slipstream.bench.http_client import body_chunks as _body_chunks
from slipstream.bench.http_client import open_request as _http

NUM_REQUESTS, CONCURRENCY = 256, 64


async def _stream(url: str, body: dict, hang_up_after: int | None) -> dict:
    """Stream one completion; returns the usage, the number of events read, and the
    finish reason. With `hang_up_after`, close the connection after that many events."""
    status, reader, writer, headers = await _http(url, "POST", "/v1/completions", body, None)
    assert status == 200
    events, usage, finish, buf = 0, None, None, b""
    try:
        async for chunk in _body_chunks(reader, headers):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ")
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                assert "error" not in obj, obj
                events += 1
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj["choices"]:
                    finish = ch["finish_reason"] or finish
                if hang_up_after is not None and events >= hang_up_after:
                    return {"hung_up": True, "events": events}
    finally:
        writer.close()
    return {"hung_up": False, "events": events, "usage": usage, "finish": finish}


async def _run_load(url: str, hang_up_every: int | None, seed: int) -> list[tuple[dict, dict]]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)
    in_flight, peak = 0, 0

    async def one(i: int):
        nonlocal in_flight, peak
        hang = hang_up_every is not None and i % hang_up_every == 0
        body = {"prompt": [rng.randrange(3, 260) for _ in range(rng.randint(4, 40))],
                "max_tokens": 120 if hang else rng.randint(4, 24), "ignore_eos": True,
                "temperature": 1.0, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        async with sem:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return body, await _stream(url, body, 3 if hang else None)
            finally:
                in_flight -= 1

    results = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    assert peak == CONCURRENCY
    return results


def _wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["slipstream_requests_running"] == 0 and m["slipstream_requests_waiting"] == 0
                and m["slipstream_requests_in_flight"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _assert_pool_free(m: dict) -> None:
    assert m["slipstream_kv_cache_blocks"] == 4096
    assert m["slipstream_kv_cache_free_blocks"] == m["slipstream_kv_cache_blocks"]
    assert m["slipstream_kv_cache_usage"] == 0


def test_load_all_complete(tiny_server):
    before = tiny_server.metrics()
    results = asyncio.run(_run_load(tiny_server.url, None, seed=0))
    for body, r in results:
        assert r["usage"]["completion_tokens"] == body["max_tokens"]
        assert r["usage"]["prompt_tokens"] == len(body["prompt"])
        assert r["finish"] == "length"
    m = _wait_idle(tiny_server)
    _assert_pool_free(m)
    done = m['slipstream_requests_total{outcome="ok"}'] - before.get(
        'slipstream_requests_total{outcome="ok"}', 0)
    assert done == NUM_REQUESTS


def test_load_with_a_third_hanging_up(tiny_server):
    before = tiny_server.metrics()
    results = asyncio.run(_run_load(tiny_server.url, 3, seed=1))
    hung = [(b, r) for b, r in results if r["hung_up"]]
    kept = [(b, r) for b, r in results if not r["hung_up"]]
    assert len(hung) == -(-NUM_REQUESTS // 3)
    for body, r in kept:
        assert r["usage"]["completion_tokens"] == body["max_tokens"] and r["finish"] == "length"
    m = _wait_idle(tiny_server)
    _assert_pool_free(m)
    aborted = m['slipstream_requests_total{outcome="aborted"}'] - before.get(
        'slipstream_requests_total{outcome="aborted"}', 0)
    assert aborted == len(hung)
    # The hung-up requests stopped early: far fewer tokens than their 120 each were made.
    made = m["slipstream_generation_tokens_total"] - before["slipstream_generation_tokens_total"]
    assert made < sum(b["max_tokens"] for b, _ in kept) + 120 * len(hung) / 2


def test_non_streaming_client_hanging_up_is_aborted(tiny_server):
    """A client of a whole (non-streaming) response that hangs up aborts its request too."""
    async def scenario():
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
        clients = []
        for _ in range(4):
            reader, writer = await asyncio.open_connection("127.0.0.1", tiny_server.port)
            data = json.dumps(body).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            await writer.drain()
            clients.append(writer)
        # Hang up once the requests are generating (not after a fixed time, which a
        # fast machine would spend making most of their tokens).
        for _ in range(200):
            m = await asyncio.to_thread(tiny_server.metrics)
            if m["slipstream_generation_tokens_total"] - before["slipstream_generation_tokens_total"] >= 4:
                break
            await asyncio.sleep(0.05)
        for w in clients:
            w.close()
    before = tiny_server.metrics()
    asyncio.run(scenario())
    m = _wait_idle(tiny_server)
    _assert_pool_free(m)
    aborted = m['slipstream_requests_total{outcome="aborted"}'] - before.get(
        'slipstream_requests_total{outcome="aborted"}', 0)
    assert aborted == 4
    made = m["slipstream_generation_tokens_total"] - before["slipstream_generation_tokens_total"]
    assert made < 4 * 1000 / 2


def test_a_client_that_does_not_read_blocks_nobody(tiny_server):
    """One stream is left unread while others run to completion; it still gets every token."""
    async def scenario():
        slow = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": 5}   # large events
        status, reader, writer, headers = await _http(tiny_server.url, "POST", "/v1/completions",
                                                      slow, None)
        assert status == 200
        t0 = time.monotonic()
        fast = [{"prompt": [9, 10, i + 11], "max_tokens": 16, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}} for i in range(8)]
        done = await asyncio.gather(*(_stream(tiny_server.url, b, None) for b in fast))
        fast_s = time.monotonic() - t0
        assert all(r["usage"]["completion_tokens"] == 16 for r in done)
        raw = b"".join([c async for c in _body_chunks(reader, headers)]).decode()
        writer.close()
        usage = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")][-1]
        return fast_s, usage["usage"]["completion_tokens"], time.monotonic() - t0
    fast_s, slow_tokens, total_s = asyncio.run(scenario())
    assert slow_tokens == 900
    assert fast_s < total_s
