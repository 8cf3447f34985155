"""The router's HTTP side: the OpenAI API of `slipstream serve`, proxied to its instances.

POST /v1/completions and /v1/chat/completions (streaming or not) go to the
instance `policy.Router` picks for the prompt; the body is passed through
unchanged, and the answer comes back as the instance gave it, with the header
`x-slipstream-instance` naming the instance. GET /v1/models comes from any live
instance; GET /health answers 200 while one is live; GET /router/state lists
the instances.

The prompt's token ids (for its block hashes) come from the model's tokenizer,
as the instances tokenize: text prompts encoded, chat messages through the chat
template. A body the router cannot read is routed by load alone; the instance
then answers with its own error.

Failure: a poll every `poll_interval` seconds finds dead instances (and live
ones again). An instance that cannot be reached when a request is sent is
marked dead and the request goes to the next one. One that fails while
answering fails that request only: a 502 error object, or an error event and
[DONE] on a stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.cache.prefix_cache import BlockHasher
from slipstream.router import upstream
from slipstream.router.instance_state import HASH_BYTES
from slipstream.router.policy import Router
from slipstream.server.protocol import error_body

log = logging.getLogger("slipstream.router")
FORWARDED = ("authorization", "content-type", "accept")


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse(error_body(message, None, kind, status), status_code=status)


class RouterServer:
    def __init__(self, router: Router, tokenizer, poll_interval: float = 0.5,
                 connect_timeout: float = 3.0, read_timeout: float = 600.0,
                 api_key: str | None = None):
        self.router = router
        # the instances' key, for the router's own polls
        self.poll_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self.poll_interval = poll_interval
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout

    # ---- instance state ------------------------------------------------------

    async def poll_once(self) -> None:
        async def one(inst):
            try:
                resp = await upstream.request(inst.url, "GET", "/v1/cache/state",
                                              headers=self.poll_headers,
                                              connect_timeout=self.connect_timeout,
                                              read_timeout=max(2.0, 4 * self.poll_interval))
                body = await resp.read()
                if resp.status != 200:
                    raise upstream.UpstreamError(f"/v1/cache/state answered {resp.status}")
                inst.update(json.loads(body))
            except (ConnectionError, ValueError, KeyError) as e:
                if inst.alive:
                    log.warning("instance %s is down: %s", inst.url, e)
                inst.down(str(e))
        await asyncio.gather(*(one(i) for i in self.router.instances))

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad answer
                log.exception("poll failed")

    # ---- prompts -------------------------------------------------------------

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            return []
        if chat:
            from slipstream.server.protocol import ChatCompletionRequest
            req = ChatCompletionRequest.model_validate(body)
            text = tok.apply_chat_template(req.chat_messages(),
                                           add_generation_prompt=req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]   # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return []

    def block_hashes(self, ids: list[int]) -> list[bytes]:
        bs = self.router.block_size
        if not ids or bs is None:
            return []
        hashes: list[bytes] = []
        BlockHasher(bs).extend(hashes, ids)
        # An instance never reuses the last token's block; views hold truncated hashes.
        return [h[:HASH_BYTES] for h in hashes[:(len(ids) - 1) // bs]]

    # ---- proxying ------------------------------------------------------------

    async def generate(self, request: Request, chat: bool):
        """Proxy one request; a client that hangs up before the answer started (a
        non-streaming one: before it is whole) closes the instance's connection,
        which aborts the request there."""
        raw = await request.body()       # before the watch, which reads the same channel
        work = asyncio.create_task(self._generate(request, raw, chat))

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        return Response(status_code=499)

    async def _generate(self, request: Request, raw: bytes, chat: bool):
        try:
            body = json.loads(raw)
            ids = await asyncio.to_thread(self.prompt_ids, body, chat) if isinstance(body, dict) else []
        except Exception:  # noqa: BLE001 - the instance reports a bad body itself
            body, ids = None, []
        hashes = self.block_hashes(ids)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: set[str] = set()
        while True:
            choice = self.router.choose(hashes, tried)
            if choice is None:
                down = "; ".join(f"{i.url}: {i.last_error or 'not answering'}"
                                 for i in self.router.instances)
                return _error(503, f"no engine instance is available ({down})")
            inst, _ = choice
            tried.add(inst.url)
            inst.in_flight += 1
            # Counted before the answer: a second request sharing the prefix that comes
            # while this one is computed (a non-streaming answer arrives whole) follows it.
            self.router.routed(inst, hashes)
            try:
                resp = await upstream.request(inst.url, "POST", path, raw, headers,
                                              self.connect_timeout, self.read_timeout)
            except asyncio.CancelledError:      # the client left (generate's watch)
                inst.in_flight -= 1
                raise
            except upstream.Unreachable as e:
                inst.in_flight -= 1
                inst.down(str(e))
                log.warning("instance %s unreachable, trying another: %s", inst.url, e)
                continue
            except upstream.UpstreamError as e:
                inst.in_flight -= 1
                return _error(502, f"engine instance {inst.url} failed while serving this "
                                   f"request: {e}")
            break
        extra = {"x-slipstream-instance": inst.url}
        media = resp.headers.get("content-type", "application/json")
        if stream and resp.status == 200:
            done = _Release(inst, resp)   # after the stream, also one whose client left early
            return StreamingResponse(self._relay(inst, resp, done), status_code=200,
                                     media_type=media, background=BackgroundTask(done),
                                     headers={**extra, "Cache-Control": "no-cache"})
        try:
            content = await resp.read()
        except upstream.UpstreamError as e:
            return _error(502, f"engine instance {inst.url} failed while serving this request: {e}")
        finally:
            inst.in_flight -= 1
        return Response(content, status_code=resp.status, media_type=media, headers=extra)

    async def _relay(self, inst, resp, done: "_Release"):
        try:
            async for chunk in resp.chunks():
                yield chunk
        except upstream.UpstreamError as e:
            err = error_body(f"engine instance {inst.url} failed while serving this request: {e}",
                             None, "server_error", 502)
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            done()

    async def models(self, request: Request):
        """GET /v1/models and /v1/models/NAME, from the first live instance."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        for inst in self.router.live():
            try:
                resp = await upstream.request(inst.url, "GET", request.url.path, b"", headers,
                                              self.connect_timeout, 30.0)
                return Response(await resp.read(), status_code=resp.status,
                                media_type=resp.headers.get("content-type", "application/json"))
            except ConnectionError:
                continue
        return _error(503, "no engine instance is available")


class _Release:
    """Ends a relayed stream once: the instance's in-flight count and its connection."""

    def __init__(self, inst, resp):
        self.inst, self.resp, self.done = inst, resp, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.inst.in_flight -= 1
            self.resp.close()


def build_router_app(server: RouterServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.poll_once()
        task = asyncio.create_task(server.poll_forever())
        yield
        task.cancel()

    app = FastAPI(title="slipstream router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.get("/health")
    async def health():
        live = len(server.router.live())
        if not live:
            return _error(503, "no engine instance is available")
        return {"status": "ok", "live_instances": live}

    @app.get("/router/state")
    async def state():
        return {"block_size": server.router.block_size,
                "instances": [i.describe() for i in server.router.instances]}

    @app.get("/v1/models")
    async def models(request: Request):
        return await server.models(request)

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):   # the client's models.retrieve
        return await server.models(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):       # 404 / 405 as OpenAI error objects, as serve's
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                      "invalid_request_error")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    return app
