"""The FastAPI application: OpenAI endpoints under ``/v1``, the API's description (``/openapi.json``,
``/docs``) and the run-time settings (``GET``/``POST /admin/config``, see ``engine.live_config``), all
API key protected when one is set, plus the open operational endpoints ``/health``, ``/metrics`` and
``/version`` (open as in vLLM: probes and Prometheus carry no key)."""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot import __version__
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.server import protocol
from kvpilot.engine.server.chat import create_chat_completion
from kvpilot.engine.server.completions import create_completion
from kvpilot.engine.server.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    APIError,
    ClientDisconnected,
    bad_request,
    error_body,
    from_exception,
    refusal_reason,
)
from kvpilot.engine.server.intake import GENERATION_PATHS
from kvpilot.engine.server.serving import ServerState
from kvpilot.engine.server.streaming import load_stream_backend

logger = logging.getLogger("kvpilot.server")

REQUEST_ID_HEADER = "x-request-id"
_SAFE_REQUEST_ID = re.compile(r"^[\w.:@/+=-]{1,128}$")
# nginx's code for "client closed the request": shows up in access logs; nobody receives it.
CLIENT_CLOSED_REQUEST = 499
# Paths (and the folders below them) that require the API key when one is set.
PROTECTED_PATHS = ("/v1", "/openapi.json", "/docs", "/admin")


def requires_api_key(path: str) -> bool:
    """Whether ``path`` is one of :data:`PROTECTED_PATHS` or below one of them."""
    return any(path == p or path.startswith(p + "/") for p in PROTECTED_PATHS)


class ServerMiddleware:
    """Pure ASGI middleware (no buffering, so streaming and disconnects pass straight through):
    checks the API key on the protected paths and echoes ``X-Request-Id`` (the client's, or a new one)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        given = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), id_header]
            await send(message)

        if requires_api_key(scope["path"]):
            authorization = headers.get(b"authorization")
            error = self.state.check_api_key(authorization.decode("latin-1") if authorization else None)
            if error is not None:
                await error.response()(scope, receive, send_with_id)
                return
        if scope["path"] in GENERATION_PATHS and scope["method"] == "POST" and self.state.metrics is not None:
            # Timed up to the hand-off to the engine (serving.submit): kvpilot_engine_request_intake_seconds.
            intake = self.state.intakes.begin()
            scope["state"]["intake"] = intake
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self.state.intakes.end(intake)  # failed before the hand-off: not counted
            return
        if scope["path"] == "/metrics" and self.state.metrics is not None:
            self.state.intakes.interrupt()
            # A scrape is a turn of the server's on the interpreter the engine's steps share: time it
            # whole (routing, rendering, sending) for kvpilot_engine_metrics_render_seconds.
            start = time.perf_counter()
            await self.app(scope, receive, send_with_id)
            self.state.metrics.record_scrape(time.perf_counter() - start)
            return
        await self.app(scope, receive, send_with_id)


def build_app(state: ServerState) -> FastAPI:
    """The application over ``state``; its lifespan starts and stops the engine loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        await load_stream_backend()
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="kvpilot", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.server = state
    app.add_middleware(ServerMiddleware, state=state)

    def count_refusal(request: Request, error: APIError) -> None:
        # Only the generation API: an admin call's 400 is no refused request.
        reason = refusal_reason(error)
        if reason is not None and state.metrics is not None and request.url.path.startswith("/v1/"):
            state.metrics.record_refused(reason)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        count_refusal(request, exc)
        if exc.status >= 500 and exc.code != "server_overloaded":  # overload is routine: no log flood
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            error_body(str(exc.detail), INVALID_REQUEST, code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        count_refusal(request, bad_request(str(exc)))
        return JSONResponse(error_body(str(exc), INVALID_REQUEST), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        error = from_exception(exc)
        count_refusal(request, error)
        if error.status >= 500:  # a typed request error that got this far is the client's, not a bug
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error.response()

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(
            error_body(state.engine.health_detail, SERVER_ERROR, code="engine_dead"), status_code=503
        )

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/config")
    async def read_config() -> dict:
        return state.engine.live_config().as_dict()

    @app.post("/admin/config")
    async def write_config(request: Request) -> dict:
        body = await protocol.read_json_body(request)
        try:
            live = await state.engine.reconfigure(body)
        except ConfigError as exc:
            raise bad_request(str(exc), param=_first_key(body), code="invalid_config") from None
        return live.as_dict()

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(state, name) for name in state.served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        return _model_card(state, state.resolve_model(model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await protocol.read_json_body(request)
        protocol.check_limits(body, state.limits, is_chat=False)
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await protocol.read_json_body(request)
        protocol.check_limits(body, state.limits, is_chat=True)
        return await create_chat_completion(state, body, request)

    return app


def _first_key(body: dict) -> str | None:
    return next(iter(body), None) if isinstance(body, dict) else None


def _model_card(state: ServerState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "kvpilot",
        "root": state.model_dir,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
