"""The HTTP API: `create_app(settings)`; run it with `uvicorn --factory bulkinfer.api.app:create_app`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic.json_schema import models_json_schema

from bulkinfer.api.auth import ApiKeyCheck, parse_keys
from bulkinfer.api.auth_failures import AuthFailureLimit
from bulkinfer.api.body_limit import BodyCheck
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.dispatch import CeleryTaskSender
from bulkinfer.api.errors import install_error_handlers
from bulkinfer.api.methods import install_method_handlers
from bulkinfer.api.metrics import service_registry
from bulkinfer.api.rate_limit import RateLimit
from bulkinfer.api.routes import anthropic_batches as anthropic_batch_routes
from bulkinfer.api.routes import jobs as job_routes
from bulkinfer.api.routes import observe as observe_routes
from bulkinfer.api.routes import openai_batches as openai_batch_routes
from bulkinfer.api.routes import openai_files as openai_file_routes
from bulkinfer.api.routes import schedules as schedule_routes
from bulkinfer.api.routes import service as service_routes
from bulkinfer.api.upload import UPLOAD_FORM_BYTES
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec

API_VERSION = "0.1.0"
DESCRIPTION = """Batch LLM inference over object storage. Submit a job (a JobSpec naming rows in S3 or
the local store, or an uploaded file), watch its counts, and read its output parts when it has
succeeded. Errors are `{"detail": message, "messages": [one line per problem]}`."""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The API for `settings` (default: from the `BULKINFER_*` variables)."""
    settings = settings or Settings.from_env()
    context = ApiContext(settings=settings, repository=settings.repository(),
                         registry=settings.model_registry(), tasks=CeleryTaskSender(settings.broker_url))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        context.tasks.close()
        context.repository.redis.close()

    failures = AuthFailureLimit(context.repository.redis, context.repository.namespace,
                                settings.max_auth_failures_per_min)
    auth = ApiKeyCheck(parse_keys(settings.api_keys, settings.admin_api_keys), failures)
    # With keys, the schema and its page are behind them too (FastAPI's own docs routes skip app
    # dependencies): they are served below by routes that need a key.
    hidden = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    docs: dict[str, Any] = {} if not auth.enabled else hidden
    repository = context.repository
    rate_limit = RateLimit(repository.redis, repository.namespace, settings.max_requests_per_s)
    app = FastAPI(title="bulkinfer", version=API_VERSION, description=DESCRIPTION, lifespan=lifespan,
                  dependencies=[Depends(auth), Depends(rate_limit)], **docs)
    app.state.context = context
    app.state.auth = auth
    app.state.metrics = service_registry(context.repository, context.registry)
    install_error_handlers(app)
    # Every body before a route reads it, whatever its content type: one tenant's huge body is not
    # everyone's, and a small JSON one's depth and Unicode are checked once.
    upload_limit = settings.max_upload_bytes + UPLOAD_FORM_BYTES
    app.add_middleware(BodyCheck, streamed={anthropic_batch_routes.PATH: settings.max_message_batch_bytes},
                       uploads={"/jobs": upload_limit, "/v1/files": upload_limit})
    install_method_handlers(app)
    app.include_router(job_routes.router)
    app.include_router(service_routes.router)
    app.include_router(schedule_routes.router)
    app.include_router(observe_routes.router)
    # The OpenAI and Anthropic wire formats, over the same jobs, keys and tenants.
    app.include_router(openai_file_routes.router)
    app.include_router(openai_batch_routes.router)
    app.include_router(anthropic_batch_routes.router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            # The submit body is read by hand (JSON or multipart), so JobSpec is added here.
            _, definitions = models_json_schema([(JobSpec, "validation")],
                                                ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if auth.enabled:
        @app.get("/openapi.json", include_in_schema=False)
        def openapi_behind_keys() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        def docs_behind_keys() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="bulkinfer API")
    return app
