"""Service routes: health and the served models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from bulkinfer.api.dependencies import Context
from bulkinfer.api.health import health
from bulkinfer.api.schemas import Health, ModelList

router = APIRouter(tags=["service"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}},
            summary="Redis and the object store are reachable")
def healthz(request: Request, context: Context) -> Health | JSONResponse:
    """Open to all; with API keys set, a failing check says what kind of failure only."""
    result = health(context, detailed=not request.app.state.auth.enabled)
    if result.status != "ok":
        failing = "; ".join(f"{name}: {state}" for name, state in result.checks.items() if state != "ok")
        return JSONResponse({"detail": failing, **result.model_dump()}, status_code=503)
    return result


# `adapters` is left out when no model has any: a deployment without LoRA answers as it always did.
@router.get("/models", response_model=ModelList, response_model_exclude_defaults=True,
            summary="The models this deployment serves, and their LoRA adapters")
def list_models(context: Context) -> ModelList:
    registry = context.registry
    adapters = {name: registry.adapters_of(name) for name in registry.names()}
    return ModelList(models=registry.names(),
                     adapters={name: names for name, names in adapters.items() if names})
