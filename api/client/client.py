"""`Client` and `AsyncClient`: a transport plus the resources mounted on it.

A resource is a class that takes the transport (`_transport`, with `request(method, path, *, json=None,
params=None, idempotent=...)`) and is mounted as an attribute below: one line per resource.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import httpx

from bulkinfer.api.client.jobs import AsyncJobs, Jobs
from bulkinfer.api.client.schedules import AsyncSchedules, Schedules
from bulkinfer.api.client.transport import AsyncTransport, RetryPolicy, Transport
from bulkinfer.jobs.state.usage import UsageReport

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
API_URL_ENV = "BULKINFER_API_URL"
API_KEY_ENV = "BULKINFER_API_KEY"


def usage_params(since: datetime | None, until: datetime | None, tenant: str | None,
                 model: str | None) -> dict[str, str]:
    params = {"since": since.isoformat() if since else None, "until": until.isoformat() if until else None,
              "tenant": tenant, "model": model}
    return {name: value for name, value in params.items() if value is not None}


def resolve_base_url(base_url: str | None) -> str:
    return base_url or os.environ.get(API_URL_ENV) or DEFAULT_BASE_URL


def resolve_api_key(api_key: str | None) -> str | None:
    return api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None


class Client:
    """The bulkinfer API over HTTP (sync).

        with Client("http://127.0.0.1:8000", api_key="...", timeout=30, retries=3) as client:
            job = client.jobs.create(input="rows.jsonl", model="small", prompt_column="q")
            job = client.jobs.wait(job, timeout=600)
            table = client.jobs.results(job).to_arrow()

    `base_url` defaults to $BULKINFER_API_URL (else http://127.0.0.1:8000) and `api_key` to
    $BULKINFER_API_KEY; the key goes as `Authorization: Bearer <key>`. `retries` and `backoff`: see
    `bulkinfer.api.client.transport`. `http_transport` replaces httpx's (tests: `httpx.MockTransport`).
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.5, headers: Mapping[str, str] | None = None,
                 http_transport: httpx.BaseTransport | None = None) -> None:
        self._transport = Transport(resolve_base_url(base_url), api_key=resolve_api_key(api_key),
                                    timeout=timeout, retry=RetryPolicy(retries=retries, backoff=backoff),
                                    headers=headers, http_transport=http_transport)
        self.jobs = Jobs(self._transport)
        self.schedules = Schedules(self._transport)

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    def models(self) -> list[str]:
        """The model names this deployment serves."""
        return list(self._transport.request("GET", "/models", idempotent=True).json()["models"])

    def lora_adapters(self) -> dict[str, list[str]]:
        """Each served model's LoRA adapters by name (models without any are left out)."""
        return dict(self._transport.request("GET", "/models", idempotent=True).json().get("adapters", {}))

    def health(self) -> dict[str, Any]:
        """The health report; `ApiError` (503) when a backing service is down."""
        return dict(self._transport.request("GET", "/healthz", idempotent=False).json())

    def usage(self, *, since: datetime | None = None, until: datetime | None = None,
              tenant: str | None = None, model: str | None = None) -> UsageReport:
        """Rows, tokens and engine seconds per tenant and model in [since, until) (by the hour;
        default: the last 30 days). A tenant's key sees its own tenant only."""
        response = self._transport.request("GET", "/usage", params=usage_params(since, until, tenant, model),
                                           idempotent=True)
        return UsageReport.model_validate(response.json())

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class AsyncClient:
    """`Client` over `httpx.AsyncClient`: the same resources, every call awaited.

        async with AsyncClient(url) as client:
            job = await client.jobs.create(input=rows, model="small", prompt_column="q")
            job = await client.jobs.wait(job)
            async for row in client.jobs.results(job): ...
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 0.5, headers: Mapping[str, str] | None = None,
                 http_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._transport = AsyncTransport(resolve_base_url(base_url), api_key=resolve_api_key(api_key),
                                         timeout=timeout, retry=RetryPolicy(retries=retries, backoff=backoff),
                                         headers=headers, http_transport=http_transport)
        self.jobs = AsyncJobs(self._transport)
        self.schedules = AsyncSchedules(self._transport)

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    async def models(self) -> list[str]:
        response = await self._transport.request("GET", "/models", idempotent=True)
        return list(response.json()["models"])

    async def lora_adapters(self) -> dict[str, list[str]]:
        response = await self._transport.request("GET", "/models", idempotent=True)
        return dict(response.json().get("adapters", {}))

    async def usage(self, *, since: datetime | None = None, until: datetime | None = None,
                    tenant: str | None = None, model: str | None = None) -> UsageReport:
        response = await self._transport.request("GET", "/usage",
                                                 params=usage_params(since, until, tenant, model),
                                                 idempotent=True)
        return UsageReport.model_validate(response.json())

    async def health(self) -> dict[str, Any]:
        return dict((await self._transport.request("GET", "/healthz", idempotent=False)).json())

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()
