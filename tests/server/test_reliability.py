"""Faults: a step that raises fails only its own requests (500) and the server goes on;
a full server answers 503; SIGTERM drains in-flight streams, then exits; the API key."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request

import pytest

from slipstream.bench.http_client import body_chunks as _body_chunks
from slipstream.bench.http_client import open_request as _http
from tests.server.conftest import TINY_ARGS, ServerProcess, free_port


class InProcessServer:
    """build_app on uvicorn in a thread, so the test can reach into the engine."""

    def __init__(self, engine, **kw):
        import uvicorn

        from slipstream.server.api_server import build_app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, "tiny", **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


async def _collect(url, path, body, key=None):
    status, reader, writer, headers = await _http(url, "POST", path, body, key)
    raw = b"".join([c async for c in _body_chunks(reader, headers)])
    writer.close()
    return status, raw.decode()


def _events(raw: str) -> list:
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


def make_engine(tiny_model_dir, **kw):
    from slipstream.engine.args import EngineArgs
    from slipstream.engine.engine import Engine
    return Engine(EngineArgs(model=str(tiny_model_dir), dtype="float32", device="cpu",
                             block_size=4, num_kv_blocks=512, max_num_seqs=1, **kw))


@pytest.fixture
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.mark.parametrize("where", ["step", "forward"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_exception_fails_only_its_requests(tiny_model_dir, async_scheduling, where):
    """max_num_seqs=1: A runs, B waits. A step that raises while A runs fails A (500 in
    its stream) and not B, which then completes; so does a request sent afterwards.
    The fault is raised at the start of `Engine.step` or inside the model runner's forward
    (after scheduling allocated blocks); also with async scheduling (the GPU default:
    outputs lag launches by one step)."""
    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling)
    owner, name = (engine, "step") if where == "step" else (engine.runner, "execute")
    real, calls = getattr(owner, name), {"n": 0, "fail_at": None}

    def faulty(*a, **kw):
        calls["n"] += 1
        if calls["fail_at"] is not None and calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected fault")
        time.sleep(0.01)   # A (at most ~250 steps) must still be running when the fault comes
        return real(*a, **kw)
    setattr(owner, name, faulty)
    srv = InProcessServer(engine)
    try:
        async def scenario():
            body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
            status, reader, writer, headers = await _http(srv.url, "POST", "/v1/completions",
                                                          body, None)
            assert status == 200
            chunks = _body_chunks(reader, headers)
            await chunks.__anext__()                       # A is running
            b = asyncio.create_task(_collect(srv.url, "/v1/completions", {
                "prompt": [8, 9], "max_tokens": 5, "ignore_eos": True}))
            await asyncio.sleep(0.3)                        # B is queued behind A
            calls["fail_at"] = calls["n"] + 2
            rest = b"".join([c async for c in chunks]).decode()
            writer.close()
            return rest, await b
        rest, (b_status, b_raw) = asyncio.run(scenario())
        errors = [e for e in _events(rest) if "error" in e]
        assert errors and errors[0]["error"]["code"] == 500
        assert "injected fault" in errors[0]["error"]["message"]
        assert rest.rstrip().endswith("data: [DONE]")
        assert b_status == 200 and json.loads(b_raw)["usage"]["completion_tokens"] == 5
        status, raw = asyncio.run(_collect(srv.url, "/v1/completions", {
            "prompt": "hello", "max_tokens": 3, "ignore_eos": True}))
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        # non-streaming request in a failing step: HTTP 500 with an error object
        calls["fail_at"] = calls["n"] + 2
        status, raw = asyncio.run(_collect(srv.url, "/v1/completions", {
            "prompt": "hello", "max_tokens": 50, "ignore_eos": True}))
        assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"
        time.sleep(0.2)
        assert not engine.has_unfinished_requests()
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
        assert srv.app.state.server.async_engine.stats.step_errors == 2
    finally:
        srv.stop()


def test_queue_limit_answers_503(engine):
    srv = InProcessServer(engine, max_queued=1)   # 1 running + 1 queued
    try:
        async def scenario():
            # Long enough that both still run when the third arrives, on any CPU.
            body = {"prompt": [5, 6], "max_tokens": 1000, "ignore_eos": True}
            first = [asyncio.create_task(_collect(srv.url, "/v1/completions", body))
                     for _ in range(2)]
            await asyncio.sleep(0.3)
            third = await _collect(srv.url, "/v1/completions", body)
            return [await t for t in first], third
        first, (status, raw) = asyncio.run(scenario())
        assert status == 503 and json.loads(raw)["error"]["type"] == "server_overloaded"
        assert [s for s, _ in first] == [200, 200]
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            assert 'slipstream_requests_total{outcome="refused"} 1.0' in r.read().decode()
        from slipstream.server.api_server import _error
        assert _error(503, "busy").headers["retry-after"] == "1"
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_streams(tiny_model_dir, tmp_path):
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_ARGS], tmp_path / "drain.log")
    try:
        async def scenario():
            body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            status, reader, writer, headers = await _http(server.url, "POST", "/v1/completions",
                                                          body, None)
            chunks = _body_chunks(reader, headers)
            first = await chunks.__anext__()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(OSError):             # no new connections while draining
                await _http(server.url, "GET", "/health", None, None)
            rest = b"".join([c async for c in chunks]).decode()
            writer.close()
            return (first.decode() + rest)
        raw = asyncio.run(scenario())
        usage = [e for e in _events(raw) if e.get("usage")][-1]["usage"]
        assert usage["completion_tokens"] == 900
        assert raw.rstrip().endswith("data: [DONE]")
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_api_key(tiny_model_dir, tmp_path):
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_ARGS, "--api-key", "s3cret"],
                           tmp_path / "key.log")
    try:
        import urllib.error
        assert server.get("/health") == '{"status":"ok"}'
        assert "<html" in server.get("/")
        for path in ("/v1/models", "/metrics", "/version"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                with pytest.raises(urllib.error.HTTPError) as e:
                    server.get(path, headers)
                assert e.value.code == 401
            assert server.get(path, {"Authorization": "Bearer s3cret"})
        body = {"prompt": "hi", "max_tokens": 2}
        status, obj = server.post("/v1/completions", body)
        assert status == 401 and obj["error"]["type"] == "authentication_error"
        assert obj["error"]["code"] == "invalid_api_key"     # OpenAI's code
        status, obj = server.post("/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert status == 200
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].id
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                          max_retries=0).models.list()
    finally:
        server.stop()
