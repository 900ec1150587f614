"""The OpenAI-compatible routes: one ``APIRouter`` of the node's app (``node.serving.server_app``).

``GET /v1/models`` (and ``/v1/models/<id>``), ``POST /v1/chat/completions``,
``POST /v1/completions`` (streamed or whole: ``node.serving.openai_completion``), ``GET /v1/stats``
(the caller's tenant's own counters), ``GET /health`` and ``GET /metrics`` (public unless
``metrics_auth``; ``node.serving.serve_metrics``). Request bodies are checked by
``node.serving.openai_protocol`` (OpenAI's error shape, the field named); admission is
``node.serving.fair_gate``'s; the served models are ``node.serving.served_models``' (the base and each adapter,
picked by the request's ``model``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from node.serving.openai_completion import Completion
from node.serving.openai_protocol import APIError, parse_chat, parse_completion
from node.serving.openai_state import APIConfig, OpenAIState, TenantStats
from node.serving.serve_metrics import CONTENT_TYPE, RequestRecord, health
from node.serving.server_http import BodyError, Unauthorized, read_json, tenant


__all__ = ["APIConfig", "OpenAIState", "TenantStats", "router"]


def state(request: Request) -> OpenAIState:
    return request.app.state.openai


def record(request: Request) -> RequestRecord:
    """The request's ``RequestRecord`` (``node.serving.serve_metrics``), filled by the routes."""
    return request.scope["state"]["record"]


UNAUTHORIZED = Unauthorized(APIError(401, "invalid or missing API key (Authorization: Bearer "
                                          "<token>)", None, "invalid_api_key").body(), "fedkv")
router = APIRouter()


@router.get("/health")
def get_health(request: Request) -> JSONResponse:
    """A probe: no token, nothing secret."""
    status, body = health(state(request).backend)
    return JSONResponse(body, status)


@router.get("/metrics")
def get_metrics(request: Request) -> Response:
    return Response(state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
def list_models(request: Request, _: str = Depends(tenant)) -> dict:
    st = state(request)
    return {"object": "list", "data": st.models.listing(st.created)}


@router.get("/v1/models/{model_id:path}")
def get_model(model_id: str, request: Request, _: str = Depends(tenant)) -> dict:
    st = state(request)
    found = [m for m in st.models.listing(st.created) if m["id"] == model_id]
    if not found:
        raise APIError(404, "no such model", "model", "model_not_found")
    return found[0]


@router.get("/v1/stats")
def get_stats(request: Request, who: str = Depends(tenant)) -> dict:
    st = state(request)
    own = asdict(st.stats[who])
    history = st.history() if st.history else {}
    return {"tenant": who, "model": st.backend.model_id, "version": st.backend.version,
            **history, **own}


async def _params(request: Request, parse, who: str):
    st = state(request)
    record(request).tenant = who
    try:
        body = await read_json(request, st.config.max_body, st.config.socket_timeout_s)
    except BodyError as e:
        raise APIError(e.status, str(e), None, "invalid_body" if e.status == 408 else None)
    return parse(body, st.models.names(), st.max_tokens())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, who: str = Depends(tenant)) -> Response:
    st = state(request)
    p = await _params(request, parse_chat, who)
    prompt = await run_in_threadpool(st.codec.messages, p.prompt)
    return await Completion(st, record(request), who, p, chat=True).run(prompt)


@router.post("/v1/completions")
async def completions(request: Request, who: str = Depends(tenant)) -> Response:
    st = state(request)
    p = await _params(request, parse_completion, who)
    prompt = await run_in_threadpool(st.codec.text, p.prompt)
    return await Completion(st, record(request), who, p, chat=False).run(prompt)


def public(metrics_auth: bool) -> Callable[[str], bool]:
    """Paths served without a token: ``/health``, and ``/metrics`` unless ``metrics_auth``."""
    open_paths = {"/health"} | (set() if metrics_auth else {"/metrics"})
    return lambda path: path in open_paths
