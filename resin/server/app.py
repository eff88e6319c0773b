"""The FastAPI application: routes, API-key check, request-size limit, and OpenAI-shaped errors."""
from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import resin
from resin.server.errors import APIError, error_response
from resin.server.protocol import ChatCompletionRequest, CompletionRequest
from resin.server.serving_chat import create_chat_completion
from resin.server.serving_common import ServerState
from resin.server.serving_completions import create_completion


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('msg')}", None
    if err.get("type") == "extra_forbidden":
        return f"unsupported parameter {'.'.join(loc)!r}", param
    if err.get("type") == "missing":
        return f"missing required parameter {'.'.join(loc)!r}", param
    return f"invalid value for {'.'.join(loc) or 'body'}: {err.get('msg')}", param


class BodyTooLarge(HTTPException):
    """An HTTPException, because FastAPI turns any other exception raised while reading a body into a 400."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes, "
                              f"--max-request-bytes)")


class BodyLimit:
    """Refuses bodies over `limit` bytes with 413: at once when Content-Length says so, else as soon as the
    streamed body passes the limit, so an oversized body is never buffered, parsed or tokenised. A plain ASGI
    middleware, not Starlette's BaseHTTPMiddleware, so handlers still see client disconnects."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.limit
        received = 0

        async def limited() -> Message:
            nonlocal received
            if too_large:
                raise BodyTooLarge(self.limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def create_app(state: ServerState, api_key: str | None = None, max_request_bytes: int = 16 << 20,
               metrics_need_key: bool = False) -> FastAPI:
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty: give a real key, or none to serve without one")
    if metrics_need_key and not api_key:
        raise ValueError("--metrics-require-api-key needs an API key (--api-key or $RESIN_API_KEY)")
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.started:  # resin run steps it in the main thread; an embedder gets a thread here
            state.engine.start()
        yield
        state.shutting_down = True
        state.engine.stop()
        if state.grammars is not None:
            state.grammars.close()

    async def check_api_key(request: Request) -> None:
        # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`, and then a
        # non-streaming handler can no longer see that its client disconnected.
        if api_key is not None:
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")

    app = FastAPI(title="Resin", version=resin.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def refused(request: Request, status: int, message: str, param: str | None = None,
                counted: bool = False) -> Response:
        # An error after admission was counted by its request already (failed in the engine, client gone).
        if request.url.path in GENERATION_ROUTES and not counted:
            state.metrics.outcome("rejected")
        return error_response(status, message, param)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return refused(request, 400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return refused(request, exc.status, exc.message, exc.param, exc.counted)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}")
        return refused(request, exc.status_code, str(exc.detail))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(state, body, raw)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, body, raw)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "resin", "max_model_len": state.max_model_len}]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return error_response(503, "the engine is not running")
        if state.shutting_down:  # load balancers stop routing here while in-flight requests finish
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": resin.__version__}

    @app.get("/metrics", dependencies=[Depends(check_api_key)] if metrics_need_key else [])
    async def metrics():
        state.metrics.update_gauges(state.engine)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app

