"""Which methods a path takes: the `Allow` header of a 405, and the answer to OPTIONS.

Starlette answers a method a path does not take with the methods of one of the path's routes only
(`/jobs` is two routes, GET and POST, so its 405 said `Allow: POST`). Here every route matching the
path counts, and OPTIONS on a known path answers 204 with the full list (OPTIONS included).
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from bulkinfer.api.errors import OPENAI_PREFIX, HttpError, error_response

CANDIDATES = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route takes at this path (asked of the router itself, so routes included
    from other routers count too), and OPTIONS when there is any."""
    methods = [method for method in CANDIDATES
               if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                      for route in app.router.routes)]
    return sorted([*methods, "OPTIONS"]) if methods else []


def install_method_handlers(app: FastAPI) -> None:
    async def not_allowed(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        if error.status_code != 405:
            if request.url.path.startswith(OPENAI_PREFIX):  # the SDKs' shape, e.g. an unknown /v1 route
                return error_response(HttpError(error.status_code, str(error.detail)), request.url.path)
            return await http_exception_handler(request, error)
        allow = allowed_methods(app, request)
        if request.method == "OPTIONS" and allow:
            return Response(status_code=204, headers={"Allow": ", ".join(allow)})
        allowed = ", ".join(allow)
        return error_response(HttpError(405, f"{request.method} is not allowed on {request.url.path} "
                                            f"(allowed: {allowed})", headers={"Allow": allowed}),
                              request.url.path)

    app.add_exception_handler(StarletteHTTPException, not_allowed)
