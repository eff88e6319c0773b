"""The FastAPI application: routes, API-key check, and OpenAI-shaped errors."""
from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

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


def create_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.alive:
            state.engine.start()
        yield
        state.shutting_down = True
        state.engine.stop()

    async def check_api_key(request: Request) -> None:
        # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`, and then a
        # non-streaming handler can no longer see that its client disconnected.
        if api_key:
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")

    app = FastAPI(title="Resin", version=resin.__version__, lifespan=lifespan)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

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
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": resin.__version__}

    @app.get("/metrics")
    async def metrics():
        state.metrics.update_gauges(state.engine.engine)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(404, f"no route {request.method} {request.url.path}")

    return app

