"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

Every bad request answers 4xx with an OpenAI error object naming the field;
a step that raised answers 500 to its own requests only; a full server
answers 503; a client that goes away aborts its requests, which frees their
KV blocks. Bodies are read and parsed here (not by FastAPI), so the size
limit (413), malformed JSON and schema errors all take the same path.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.server.async_engine import (AsyncEngine, EngineStopped, Overloaded, StepError,
                                           TooLarge)
from slipstream.server.metrics import ServerMetrics
from slipstream.server.openai_format import SSE_DONE, Formatter, sse
from slipstream.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                        DetokenizeRequest, RequestError, TokenizeRequest,
                                        check_text, error_body, refuse_unsupported,
                                        template_messages)

log = logging.getLogger("slipstream.server")
OPEN_PATHS = {"/health", "/", "/favicon.ico"}  # the chat page holds no data; its calls carry the key


def _error(status: int, message: str, param=None, kind="invalid_request_error", code=None):
    # 503 (overloaded, stopped): clients that honour Retry-After wait a second, not spin.
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(message, param, kind, code if code is not None else status),
                        status_code=status, headers=headers)


def _validation_message(e: ValidationError) -> RequestError:
    errors = e.errors()
    err = errors[0]

    def where(error) -> list[str]:      # the field, without the union members' tags
        return [str(x) for x in error["loc"] if not (isinstance(x, str) and ("[" in x or x in
                ("str", "int", "float", "bool", "list", "dict")))]
    loc = where(err)
    param = ".".join(loc) if loc else None
    kinds = {x["type"] for x in errors if where(x) == loc}
    if "finite_number" in kinds:        # JSON's NaN or Infinity where a number belongs
        msg = "must be a finite number (not NaN or Infinity)"
    elif {"int_type", "float_type"} <= kinds:
        msg = "Input should be a number"
    else:
        msg = err["msg"]
    return RequestError(f"{param or 'body'}: {msg}", param)


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None = None,
                 max_queued: int = 1024, max_request_bytes: int = 2 << 20):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics(model_name)
        self.async_engine = AsyncEngine(engine, max_queued, on_output=self.metrics.observe)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.model_config.vocab_size

    # ---- request plumbing -------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None or request.url.path in OPEN_PATHS:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        if scheme.lower() != "bearer" or not ok:
            raise RequestError("invalid or missing API key: send 'Authorization: Bearer KEY'",
                               None, 401, "authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise RequestError(f"the request body is over the limit of {self.max_request_bytes} "
                               "bytes", None, 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                raise RequestError(f"the request body is over the limit of "
                                   f"{self.max_request_bytes} bytes", None, 413)
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}", None) from None
        except RecursionError:
            raise RequestError("the body is nested too deeply to parse", None) from None
        if not isinstance(obj, dict):
            raise RequestError("the body must be a JSON object", None)
        return obj

    async def _parsed(self, request: Request, schema):
        """The request's body as `schema` (auth, size, JSON, fields and model checked)."""
        self.check_auth(request)
        body = await self.read_json(request)
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            raise _validation_message(e) from None
        refuse_unsupported(body, set(schema.model_fields))
        ignored = sorted(set(body) - set(schema.model_fields))
        if ignored:     # as vLLM does: accepted, and said so in the log
            log.warning("fields present in the request but ignored: %s", ", ".join(ignored))
        self.check_model(req.model)
        return req

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.engine.config.model):
            # 404 model_not_found, as the OpenAI API (and vLLM) answer a model they lack.
            raise RequestError(f"model: '{name}' is not served here; this server serves "
                               f"'{self.model_name}'", "model", 404, code="model_not_found")

    def tokenize(self, prompt, param: str) -> tuple[str | None, list[int]]:
        """Runs in a worker thread (the tokenizer is thread-safe; the engine is not used)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(f"{param}: must not be empty", param)
            check_text(prompt, param)
            text, ids = prompt, self.engine.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not ids:
                raise RequestError(f"{param}: must not be empty", param)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"{param}: token ids must be in [0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"{param}: {len(ids)} tokens do not fit the context window of "
                               f"{self.max_model_len} tokens (at most {self.max_model_len - 1} "
                               "leave room to generate)", param)
        return text, ids

    def chat_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that refuses the messages
            raise RequestError(f"messages: the chat template refused them: {e}", "messages") from None

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = self.chat_text(req.chat_messages(), req.add_generation_prompt)
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        _, ids = self.tokenize(ids, "messages")
        return text, ids

    # ---- /tokenize, /detokenize (vLLM's) ---------------------------------------

    async def tokenize_request(self, request: Request) -> dict:
        """The ids a completion (prompt) or chat completion (messages) would be given,
        with the context window, so a client can check a prompt fits before sending it."""
        req = await self._parsed(request, TokenizeRequest)
        req.check()

        def encode() -> list[int]:
            tok = self.engine.tokenizer
            if req.prompt is not None:
                check_text(req.prompt, "prompt")
                special = True if req.add_special_tokens is None else req.add_special_tokens
                return tok.encode(req.prompt, add_special_tokens=special)
            text = self.chat_text(template_messages(req.messages), req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        ids = await asyncio.to_thread(encode)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize_request(self, request: Request) -> dict:
        req = await self._parsed(request, DetokenizeRequest)
        req.check(self.vocab_size)
        text = await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens,
                                       skip_special_tokens=False)
        return {"prompt": text}

    # ---- generation ---------------------------------------------------------

    async def generate(self, request: Request, chat: bool):
        arrival = time.monotonic()
        req = await self._parsed(request, ChatCompletionRequest if chat else CompletionRequest)
        req.check(self.max_model_len, self.vocab_size)
        if chat:
            prompts = [await asyncio.to_thread(self.chat_prompt, req)]
        else:
            prompts = [await asyncio.to_thread(self.tokenize, p, "prompt") for p in req.prompts()]
        call_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        items, index, echo = [], {}, {}
        for i, (text, ids) in enumerate(prompts):
            rid = f"{call_id}-{i}"
            params = req.sampling_params(len(ids), self.max_model_len)
            items.append(({"prompt": text, "prompt_token_ids": ids}, params, rid))
            index[rid] = i
            if not chat and req.echo:   # token ids echo as their tokens, special ones too
                echo[rid] = text if text is not None else \
                    self.engine.tokenizer.decode(ids, skip_special_tokens=False)
        logprobs = req._logprobs()
        tok = self.engine.tokenizer
        fmt = Formatter(chat, call_id, self.model_name, req.n, logprobs, index, echo,
                        decode=lambda tid: tok.decode([tid], skip_special_tokens=False),
                        score_only=not chat and req.score_only, token_bytes=tok.token_bytes)
        try:
            sub = self.async_engine.submit(items)
        except TooLarge as e:
            raise RequestError(str(e), "n") from None
        except EngineStopped as e:
            self._refused(index)
            raise RequestError(str(e), None, 503, "server_error") from None
        except Overloaded as e:
            self._refused(index)
            raise RequestError(str(e), None, 503, "server_overloaded") from None
        for rid in index:
            self.metrics.arrived(rid, arrival)
        if req.stream:
            return StreamingResponse(self._stream(sub, fmt, len(prompts), req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(sub, fmt, request)

    def _refused(self, request_ids) -> None:
        """A 503 (full or stopped) counts its requests as refused."""
        for rid in request_ids:
            self.metrics.finished(rid, "refused")

    def _finished(self, sub, outcome: str) -> None:
        for rid in sub.request_ids:
            self.metrics.finished(rid, outcome)

    async def _stream(self, sub, fmt: Formatter, num_prompts: int, include_usage: bool):
        outcome = "aborted"
        try:
            for event in fmt.first_chunks(num_prompts, include_usage):
                yield event
            async for out in sub:
                for event in fmt.chunks(out, include_usage):
                    yield event
            if include_usage:
                yield fmt.usage_chunk()
            outcome = "ok"
        except StepError as e:
            outcome = "error"
            yield sse(error_body(str(e), None, "server_error", 500))
        except Exception as e:  # noqa: BLE001 - report it to this client and go on serving
            outcome = "error"
            log.exception("stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}: {e}", None,
                                 "server_error", 500))
        finally:
            sub.close()  # aborts what has not finished (a client that went away)
            self._finished(sub, outcome)
        yield SSE_DONE

    async def _collect(self, sub, fmt: Formatter, request: Request):
        finals = {}

        async def read():
            async for out in sub:
                if out.finished:
                    finals[out.request_id] = out

        async def watch():  # a non-streaming client that hangs up aborts its request
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)

        reader, watcher = asyncio.create_task(read()), asyncio.create_task(watch())
        outcome = "aborted"
        try:
            await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                return Response(status_code=499)
            try:
                reader.result()
            except StepError as e:
                outcome = "error"
                return _error(500, str(e), kind="server_error")
            outcome = "ok"
            return JSONResponse(fmt.response([finals[rid] for rid in sub.request_ids]))
        finally:
            for t in (reader, watcher):
                t.cancel()
            sub.close()
            self._finished(sub, outcome)


def build_app(engine, model_name: str, api_key: str | None = None, max_queued: int = 1024,
              max_request_bytes: int = 2 << 20) -> FastAPI:
    server = Server(engine, model_name, api_key, max_queued, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.async_engine.start()
        yield
        await server.async_engine.stop()

    app = FastAPI(title="slipstream", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return _error(e.status, e.message, e.param, e.kind, getattr(e, "code", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(e).__name__}", kind="server_error")

    @app.get("/health")
    async def health():
        stopped = server.async_engine.stopped
        if stopped is not None:     # a router or load balancer sends its traffic elsewhere
            return JSONResponse({"status": "error", "message": stopped}, status_code=503)
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(resources.files("slipstream.server").joinpath("static/chat.html")
                            .read_text(encoding="utf-8"))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "slipstream", "max_model_len": server.max_model_len,
                "vocab_size": server.vocab_size}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):   # the client's models.retrieve
        server.check_auth(request)
        server.check_model(name)
        return model_card()

    @app.get("/version")
    async def version(request: Request):
        server.check_auth(request)
        from slipstream import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.check_auth(request)
        body = server.metrics.render(server.async_engine.stats, len(server.async_engine._queues))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/cache/state")
    async def cache_state(request: Request):   # for a KV-aware router (slipstream/router/)
        server.check_auth(request)
        from slipstream.router.instance_state import instance_state
        ae = server.async_engine
        if ae.stopped is not None:  # the router counts this instance down
            raise RequestError(f"the engine takes no new requests: {ae.stopped}", None, 503,
                               "server_error")
        return instance_state(server.engine, ae.stats, ae.num_in_flight)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.tokenize_request(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.detokenize_request(request)

    return app
