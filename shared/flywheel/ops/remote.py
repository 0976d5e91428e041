"""``flywheel run CONFIG --remote URL``: a run started on a gateway over HTTP, as its tenant.

The config is read and checked here as ``flywheel run`` reads it (``--set``, ``--run-id``; no
import path: a tenant's config names none), then sent to ``POST URL/v1/runs`` with the
settings' ``api_key``; the gateway checks it again, within the tenant's quotas, and an
orchestrator of that deployment loads its environments and runs it. This command then
follows the run's stream (``GET /v1/runs/RUN/stream``): each status change with its reason
(what the run waits for included), each step's reward, the end. Ctrl-C stops following, not
the run (``POST /v1/runs/RUN/stop`` stops it). Files the config names (``sft.data``, a model
folder) are the deployment's: its services read them, not this machine's.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from typing import Any, TextIO

import httpx

from flywheel.contract.config import RunConfig
from flywheel.sdk import gateway

ENDED = ("finished", "failed", "stopped", "abandoned")


class RemoteRunError(RuntimeError):
    """The gateway refused the run or its stream; the message is the gateway's."""


def _refusal(response: httpx.Response) -> RemoteRunError:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    return RemoteRunError(f"{response.request.method} {response.request.url.path}: {response.status_code}: "
                          f"{detail if isinstance(detail, str) else json.dumps(detail)}")


async def start(http: httpx.AsyncClient, cfg: RunConfig) -> dict[str, Any]:
    """Register ``cfg`` on the gateway; the run as the gateway answers it."""
    config = cfg.model_dump(mode="json")
    config.pop("tenant", None)  # the key's tenant's run, whatever the file says
    response = await http.post("/v1/runs", content=json.dumps(config), headers={"Content-Type": "application/json"})
    if response.status_code != 201:
        raise _refusal(response)
    run: dict[str, Any] = response.json()
    return run


async def events(http: httpx.AsyncClient, run: str, since_step: int | None = None
                 ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The run's stream: (event, data) pairs (``status``, ``steps``, ``end``)."""
    params = {} if since_step is None else {"since_step": since_step}
    async with http.stream("GET", f"/v1/runs/{run}/stream", params=params, timeout=None) as response:
        if response.status_code != 200:
            await response.aread()
            raise _refusal(response)
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:") and event is not None:
                yield event, json.loads(line.removeprefix("data:").strip())
                event = None


async def follow(http: httpx.AsyncClient, run: str, num_steps: int, out: TextIO) -> str:
    """Print the run's status changes and steps until it ends; its last status. A stream that
    closes before the end (an hour at most) is asked again from the last step."""
    last: int | None = None
    while True:
        async for event, data in events(http, run, last):
            if event == "status":
                why = f" ({data['reason']})" if data.get("reason") else ""
                print(f"run {run}: {data['status']}{why}", file=out, flush=True)
            elif event == "steps":
                for step in data["items"]:
                    last = step["step"]
                    reward = step.get("metrics", {}).get("reward_mean")
                    shown = f"reward {reward:.3f}" if isinstance(reward, int | float) else "no reward yet"
                    print(f"step {last}/{num_steps}: {shown}", file=out, flush=True)
            elif event == "end":
                why = f": {data['reason']}" if data.get("reason") else ""
                print(f"run {run} {data['status']}{why}", file=out, flush=True)
                return str(data["status"])


async def remote_run(url: str, api_key: str | None, cfg: RunConfig, out: TextIO) -> str:
    """Start ``cfg`` on the gateway at ``url`` and follow it; its last status (``detached`` after Ctrl-C)."""
    async with gateway.async_client(url, api_key, timeout_s=60.0, from_settings=False) as http:
        run = await start(http, cfg)
        print(f"run {run['id']} registered on {url} (tenant {run['tenant']}); an orchestrator there loads its "
              "environments and starts it (Ctrl-C stops following, not the run)", file=out, flush=True)
        following = asyncio.ensure_future(follow(http, run["id"], cfg.trainer.num_steps, out))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, following.cancel)
        try:
            return await following
        except asyncio.CancelledError:
            print(f"stopped following run {run['id']}; it goes on (POST {url}/v1/runs/{run['id']}/stop stops it)",
                  file=out, flush=True)
            return "detached"
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
