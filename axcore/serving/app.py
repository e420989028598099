"""The OpenAI-compatible HTTP app (FastAPI) over any `EngineClient`.

    app = create_app(engine, TextFrontend(tokenizer, template), ServerSettings(api_key="k"))

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (the base
model, then each adapter), `GET /health` (200 `{"status": "ok"}`; 503 while draining),
`GET /metrics` (Prometheus text, `axcore.serving.metrics`). Every refusal is a JSON body
`{"error": {"message", "type", "param", "code"}}`: 400 for a malformed field (pydantic's
errors and `SamplingParamsError` alike, `param` naming the field), 401 without the
`--api-key` (on `/v1/*` only), 404 for an unknown model or route, 429 past `--max-waiting`,
503 while draining. A client that disconnects, mid-stream or while waiting, has its engine
requests aborted (`axcore.serving.runs`).
"""

from __future__ import annotations

import dataclasses
import hmac
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from axcore.engine.requests import EngineClient, GenerationRequest
from axcore.serving.metrics import CONTENT_TYPE, ServerMetrics
from axcore.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    error_body,
    sampling_params,
    validation_error,
)
from axcore.serving.responses import Answer, Deltas, body, sse
from axcore.serving.runs import Admission, ClientGone, Run
from axcore.serving.text import TextFrontend


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the server admits and answers requests."""

    # Engine requests accepted without an output yet, at most; one more is answered 429.
    max_waiting: int = 256
    # The key clients send as `Authorization: Bearer KEY` on /v1/*; None = no key needed.
    api_key: str | None = None
    # New tokens of a chat reply when the request sets no max_tokens.
    default_max_tokens: int = 256
    # Seconds between checks that a client still waiting for its answer is connected.
    disconnect_poll_s: float = 0.25


class ServerState:
    """What the routes share: the engine, the text frontend, the settings, the metrics, the admission count."""

    def __init__(self, engine: EngineClient, frontend: TextFrontend, settings: ServerSettings):
        self.engine, self.frontend, self.settings = engine, frontend, settings
        self.metrics = ServerMetrics(engine)
        self.admission = Admission(settings.max_waiting, self.metrics)
        # Set when the server stops accepting requests (SIGTERM): new /v1 requests get 503.
        self.draining = False

    def refusal(self, headers) -> RequestError | None:
        """Why a /v1 request is refused before its body is read (draining, no key), or None."""
        if self.draining:
            return RequestError("The server is shutting down; retry on another server.", status=503,
                                type_="service_unavailable", code="draining")
        key = self.settings.api_key
        if key is None:
            return None
        given = headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode("utf-8"), key.encode("utf-8")):
            return RequestError("Missing or wrong API key: send 'Authorization: Bearer KEY' with the server's "
                                "--api-key.", status=401, code="invalid_api_key")
        return None

    def model(self, name: str | None) -> tuple[str, str | None]:
        """`(model name, adapter)` for a request's `model` (None = the base); 404 RequestError if unknown."""
        names = list(self.engine.model_names())
        if name is None or name == names[0]:
            return names[0], None
        if name in names[1:]:
            return name, name
        raise RequestError(f"The model '{name}' does not exist; this server has: {', '.join(names)}.",
                           param="model", status=404, code="model_not_found")

    def start(self, requests: list[GenerationRequest], arrival: float) -> Run:
        """The requests admitted (or 429) and running."""
        self.admission.admit(len(requests))
        return Run(self.engine, requests, self.admission, self.metrics, arrival, self.settings.disconnect_poll_s)


class Gate:
    """ASGI middleware: refuses /v1 requests while draining or without the key, before anything is parsed."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            error = self.state.refusal(headers)
            if error is not None:
                await JSONResponse(error_body(error), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: EngineClient, frontend: TextFrontend, settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `engine` (default settings when None); `app.state.serving` is its `ServerState` (set
    `draining` to stop accepting)."""
    state = ServerState(engine, frontend, settings or ServerSettings())
    app = FastAPI(title="axcore", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    app.add_middleware(Gate, state=state)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        names = list(engine.model_names())
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "axcore", "root": names[0],
             "parent": None if i == 0 else names[0]} for i, name in enumerate(names)
        ]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        return await _completions(state, request, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http: Request):
        return await _chat(state, request, http)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    def answer(error: RequestError) -> JSONResponse:
        return JSONResponse(error_body(error), status_code=error.status)

    @app.exception_handler(RequestError)
    async def request_error(_, error: RequestError):
        return answer(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        return answer(validation_error(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        type_ = "invalid_request_error" if error.status_code < 500 else "server_error"
        return answer(RequestError(str(error.detail), status=error.status_code, type_=type_))

    @app.exception_handler(Exception)
    async def internal(_, error: Exception):
        return answer(RequestError(f"Internal error: {type(error).__name__}: {error}", status=500,
                                   type_="server_error"))


async def _completions(state: ServerState, request: CompletionRequest, http: Request):
    arrival = time.monotonic()
    request.refuse_unimplemented()
    model, adapter = state.model(request.model)
    prompts = request.prompts()
    ids = [state.frontend.encode(p, param="prompt") for p in prompts]
    score_only = request.max_tokens == 0
    max_tokens = 1 if score_only else (16 if request.max_tokens is None else request.max_tokens)
    prompt_logprobs = request.logprobs if (request.echo and request.logprobs is not None) else None
    params = sampling_params(request, max_tokens=max_tokens, logprobs=request.logprobs,
                             prompt_logprobs=prompt_logprobs)
    echo = [p if isinstance(p, str) else state.frontend.text(p) for p in prompts]
    answer = Answer("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, ids,
                    params.stop, request.logprobs, echo if request.echo else None, score_only, state.frontend)
    return await _run(state, answer, params, adapter, request, http, arrival)


async def _chat(state: ServerState, request: ChatCompletionRequest, http: Request):
    arrival = time.monotonic()
    request.refuse_unimplemented()
    model, adapter = state.model(request.model)
    chosen = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens = state.settings.default_max_tokens if chosen is None else chosen
    top = (request.top_logprobs or 0) if request.logprobs else None
    if request.max_completion_tokens is not None and request.max_completion_tokens < 1:
        raise RequestError("'max_completion_tokens' must be an integer >= 1.", param="max_completion_tokens")
    marker = state.frontend.marker
    params = sampling_params(request, max_tokens=max_tokens, logprobs=top, renamed={"logprobs": "top_logprobs"},
                             extra_stop=(marker,) if marker else (), extra_stop_ids=state.frontend.marker_ids)
    prompt = state.frontend.render([m.as_dict() for m in request.messages])
    answer = Answer("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, [prompt.token_ids],
                    params.stop, top, None, False, state.frontend)
    return await _run(state, answer, params, adapter, request, http, arrival)


async def _run(state, answer: Answer, params, adapter, request, http: Request, arrival: float):
    """Runs the answer's engine requests: the whole body, or (stream) the events once the first output is in."""
    requests = [GenerationRequest(f"{answer.id}-{k}", ids, params, adapter) for k, ids in enumerate(answer.prompt_ids)]
    run = state.start(requests, arrival)
    if not request.stream:
        try:
            return JSONResponse(body(answer, await run.finals(http)))
        except ClientGone:
            return Response(status_code=499)  # Nobody reads it; the requests are aborted below.
        finally:
            await run.close()
    try:  # The first output before the headers: an engine refusal is still a 4xx.
        first = await run.next(http)
    except BaseException:
        await run.close()
        raise
    usage = request.stream_options is not None and request.stream_options.include_usage
    return StreamingResponse(_events(run, Deltas(answer), first, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"}, background=BackgroundTask(run.close))


async def _events(run: Run, deltas: Deltas, first, usage: bool):
    """The stream's events: the chunks of each output, the usage if asked, `[DONE]`; closes the run at the end."""
    try:
        item = first
        while item is not None:
            for chunk in deltas.chunks(*item):
                yield sse(chunk)
            try:
                item = await run.next()
            except RequestError as e:  # The engine refused mid-stream: the error as the last event.
                yield sse(error_body(e))
                break
        if usage:
            yield sse(deltas.usage_chunk())
        yield sse("[DONE]")
    finally:
        await run.close()
