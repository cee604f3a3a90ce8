"""/v1/models (the one served model) and /health (is the database answering?)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from sqlalchemy import select

from server.auth import ProjectDep
from server.config import Settings
from server.errors import APIError, not_found
from server.models import BatchRow
from server.routes.deps import SessionDep
from server.schemas import ErrorEnvelope, Health, Model, ModelList

router = APIRouter(tags=["models"])


def served_model_name(settings: Settings) -> str:
    """The id clients put in `body.model`: the setting itself for a name (`smollm2-135m-instruct`,
    `dummy:llama-3-8b`), a folder's name or a .gguf file's stem for a path."""
    spec = settings.model
    if spec.startswith("dummy:"):
        return spec
    if spec.lower().endswith(".gguf"):
        return Path(spec).stem
    if "/" in spec or Path(spec).is_dir():
        return Path(spec.rstrip("/")).name
    return spec


@router.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorEnvelope}})
def list_models(request: Request, _: ProjectDep) -> ModelList:
    return ModelList(data=[_model(request)])


@router.get(
    "/v1/models/{model_id:path}",
    response_model=Model,
    responses={401: {"model": ErrorEnvelope}, 404: {"model": ErrorEnvelope}},
)
def retrieve_model(model_id: str, request: Request, _: ProjectDep) -> Model:
    model = _model(request)
    if model_id != model.id:
        raise not_found("Model", model_id)
    return model


def _model(request: Request) -> Model:
    return Model(
        id=served_model_name(request.app.state.settings), created=request.app.state.started_at
    )


@router.get("/health", response_model=Health, responses={503: {"model": ErrorEnvelope}})
def health(request: Request, session: SessionDep) -> Health:
    """200 when the API and its database answer (for load balancers and compose health checks)."""
    try:
        session.execute(select(BatchRow.id).limit(1))  # the schema, not just the socket
    except Exception:  # noqa: BLE001 - any failure means "not healthy"
        raise APIError(
            503, "The database is not answering.", headers={"Retry-After": "5"}
        ) from None
    return Health(model=served_model_name(request.app.state.settings))
