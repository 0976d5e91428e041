"""Reaching the gateway over HTTP: the one place its clients are made.

Every client of the gateway's API is built here (:func:`sync_client` for the hub client,
:func:`async_client` for the trace API client, :func:`health` for ``flywheel up`` and
``flywheel status``), so they agree on where the gateway is and who is calling (the settings'
``gateway_url`` and ``api_key``, unless given), on the bearer header, and on the words of a
refusal (:func:`detail_of`: the gateway's ``detail``). A test lists the modules that make one.
"""

from __future__ import annotations

from typing import Any

import httpx


def login(url: str | None, api_key: str | None, *, service_token: bool = False,
          from_settings: bool = True) -> tuple[str, dict[str, str]]:
    """The gateway's URL and the request headers of the caller: ``url`` and ``api_key`` where
    given, else (``from_settings``) the settings' ``gateway_url`` and ``api_key`` (with
    ``service_token``, a service of a deployment that wants keys falls back on its service
    token, which sees every tenant). Without ``from_settings`` no key means none is sent."""
    if from_settings and (url is None or api_key is None):
        from flywheel.contract.settings import Settings  # imported here: pydantic, only when not given

        settings = Settings.load()
        url = url if url is not None else settings.resolved_gateway_url
        if api_key is None:
            api_key = settings.api_key or (settings.service_token if service_token else None)
    if url is None:
        raise ValueError("the gateway's URL: give it, or read it from the settings (gateway_url)")
    return url.rstrip("/"), {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sync_client(url: str | None = None, api_key: str | None = None, *, timeout_s: float,
                service_token: bool = False) -> httpx.Client:
    """A blocking client of the gateway (see :func:`login`)."""
    base, headers = login(url, api_key, service_token=service_token)
    return httpx.Client(base_url=base, headers=headers, timeout=timeout_s)


def async_client(url: str | None = None, api_key: str | None = None, *, timeout_s: float,
                 from_settings: bool = True) -> httpx.AsyncClient:
    """An asyncio client of the gateway (see :func:`login`)."""
    base, headers = login(url, api_key, from_settings=from_settings)
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout_s)


def detail_of(response: httpx.Response) -> str:
    """What the gateway said of a refused request: its JSON ``detail``, else the body as text."""
    try:
        detail: Any = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        detail = response.text
    return str(detail)


async def health(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """``GET <url>/healthz`` as plain data: ``ok`` is True on 200; ``error`` when unreachable."""
    try:
        # No TLS context for plain HTTP: building one loads the system's CA bundle (about 50 ms
        # of CPU), and start-up polls the local gateway every poll_interval_s while CPU is short.
        verify = not url.startswith("http://")
        async with httpx.AsyncClient(timeout=timeout_s, verify=verify) as http:
            response = await http.get(f"{url.rstrip('/')}/healthz")
    except httpx.HTTPError as exc:
        return {"url": url, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    is_json = response.headers.get("content-type", "").startswith("application/json")
    return {"url": url, "ok": response.status_code == 200, "status_code": response.status_code,
            "detail": response.json() if is_json else response.text[:500]}
