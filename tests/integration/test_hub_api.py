"""The environment hub over HTTP, against a real nats-server and the trace store: pushes are
checked and stored whole or not at all, versions never change, forks record their lineage,
evals make a leaderboard, the package index speaks PEP 503 and 691 (and pip installs from it,
with the key and not without), and private environments show nothing to another tenant."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import keys
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.serving import serve
from flywheel_gateway.app import create_app
from tests.unit.test_hub import sdist, wheel

ENV = "acme/word-quiz"
BASE = "/v1/hub/environments"


@pytest.fixture
async def open_app(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    application = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data",
                                      gateway_max_body_bytes=1 << 20))
    async with application.router.lifespan_context(application):
        yield application



def client(app: FastAPI, key: str | None = None, **headers: str) -> httpx.AsyncClient:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", headers=headers)


def files_of(*made: tuple[str, bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (name, data, "application/octet-stream")) for name, data in made]


async def push(http: httpx.AsyncClient, env_id: str = ENV, version: str = "0.1.0", private: bool = False,
               forked_from: str | None = None, made: list[tuple[str, bytes]] | None = None) -> httpx.Response:
    project = env_id.replace("/", "_").replace("-", "_")
    made = made if made is not None else [wheel(project, version, env_id), sdist(project, version)]
    form = {"version": version, "private": str(private).lower(), **({"forked_from": forked_from} if forked_from
                                                                       else {})}
    return await http.post(f"{BASE}/{env_id}/versions", data=form, files=files_of(*made))


async def test_a_version_is_pushed_whole_listed_indexed_and_never_changes(open_app: FastAPI) -> None:
    async with client(open_app) as http:
        made = [wheel("acme_word_quiz", "0.1.0", ENV), sdist("acme_word_quiz", "0.1.0")]
        pushed = await push(http, made=made)
        assert pushed.status_code == 201, pushed.text
        assert pushed.json()["sha256"] == hashlib.sha256(made[0][1]).hexdigest()
        # The same version again, even with other content: refused, the stored one unchanged.
        again = await push(http, made=[wheel("acme_word_quiz", "0.1.0", ENV, extra={"x.txt": b"other"})])
        assert again.status_code == 409 and "acme/word-quiz@0.1.0 exists" in again.json()["detail"], again.text
        # A package that is not the environment's: refused naming the fix, nothing stored.
        bad = await push(http, version="0.2.0", made=[wheel("word_quiz", "0.2.0", ENV)])
        assert bad.status_code == 422 and "[project] name" in bad.json()["detail"], bad.text
        escaping = await push(http, version="0.2.0", made=[wheel("acme_word_quiz", "0.2.0", ENV,
                                                                 extra={"../evil.py": b"x"})])
        assert escaping.status_code == 422 and "leaves the archive's root" in escaping.json()["detail"]
        detail = (await http.get(f"{BASE}/{ENV}")).json()
        assert [v["version"] for v in detail["versions"]] == ["0.1.0"]
        assert detail["readme"] == "# word-quiz\n\nThe README." and detail["project"] == "acme-word-quiz"
        assert (await http.get(f"{BASE}")).json()["items"][0]["latest_version"] == "0.1.0"
        assert (await push(http, version="0.2.0")).status_code == 201
        detail = (await http.get(f"{BASE}/{ENV}")).json()
        assert [v["version"] for v in detail["versions"]] == ["0.2.0", "0.1.0"]

        # The index: PEP 503 HTML by default, PEP 691 JSON when asked, files with their sha256.
        listing = await http.get("/hub/simple/")
        assert listing.status_code == 200 and 'href="acme-word-quiz/"' in listing.text
        assert listing.headers["content-type"].startswith("application/vnd.pypi.simple.v1+html")
        page = await http.get("/hub/simple/acme-word-quiz/")
        sha = hashlib.sha256(made[0][1]).hexdigest()
        assert f"acme_word_quiz-0.1.0-py3-none-any.whl#sha256={sha}" in page.text, page.text
        as_json = await http.get("/hub/simple/acme-word-quiz/", headers={
            "Accept": "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1"})
        assert as_json.headers["content-type"] == "application/vnd.pypi.simple.v1+json", as_json.text
        files = {f["filename"]: f for f in as_json.json()["files"]}
        assert files["acme_word_quiz-0.1.0-py3-none-any.whl"]["hashes"] == {"sha256": sha}
        moved = await http.get("/hub/simple/Acme_Word.Quiz/")
        assert moved.status_code == 301 and moved.headers["location"].endswith("/hub/simple/acme-word-quiz/")
        assert (await http.get("/hub/simple/nobody-here/")).status_code == 404
        download = await http.get(files["acme_word_quiz-0.1.0-py3-none-any.whl"]["url"])
        assert download.status_code == 200 and download.content == made[0][1]


async def test_forks_evals_and_visibility(open_app: FastAPI) -> None:
    async with client(open_app) as http:
        assert (await push(http)).status_code == 201
        unknown = await push(http, "bob/word-quiz", forked_from="acme/word-quiz@9.9.9")
        assert unknown.status_code == 201  # the environment exists; a version it lacks is still its lineage
        assert (await push(http, "bob/other", forked_from="acme/nothing@0.1.0")).status_code == 404
        assert (await push(http, "bob/other", forked_from="acme/word-quiz")).status_code == 422
        fork = (await http.get(f"{BASE}/bob/word-quiz")).json()
        assert fork["forked_from"] == "acme/word-quiz@9.9.9"
        parent = (await http.get(f"{BASE}/{ENV}")).json()
        assert [f["id"] for f in parent["forks"]] == ["bob/word-quiz"]

        summary = {"num_tasks": 8, "num_rollouts": 16, "prompt_tokens": 100, "completion_tokens": 50}
        for model, reward in (("small", 0.25), ("big", 0.75)):
            made = await http.post(f"{BASE}/{ENV}/evals", json={
                "version": "0.1.0", "model": model, "reward_mean": reward, "reward_stderr": 0.05,
                "pass_at": {"pass@1": reward, "pass@2": min(1.0, reward * 1.5)}, **summary,
                "summary": {"env": ENV, "elapsed_s": 3.0}})
            assert made.status_code == 201, made.text
        board = (await http.get(f"{BASE}/{ENV}/evals")).json()["items"]
        assert [(e["model"], e["reward_mean"]) for e in board] == [("big", 0.75), ("small", 0.25)]
        assert (await http.get(f"{BASE}/{ENV}/evals", params={"version": "0.2.0"})).json()["items"] == []
        missing = await http.post(f"{BASE}/{ENV}/evals", json={"version": "0.2.0", "model": "m", **summary})
        assert missing.status_code == 404 and "its versions: 0.1.0" in missing.json()["detail"], missing.text
        bad = await http.post(f"{BASE}/{ENV}/evals", json={"version": "0.1.0", "model": "m", "num_tasks": 0,
                                                           "num_rollouts": 1, "pass_at": {"pass@x": 2}})
        assert bad.status_code == 422 and "num_tasks" in bad.text and "pass_at" in bad.text, bad.text

        switched = await http.patch(f"{BASE}/{ENV}", json={"private": True})
        assert switched.status_code == 200 and switched.json()["private"] is True
        assert (await http.patch(f"{BASE}/acme/nothing", json={"private": True})).status_code == 404
        assert (await http.patch(f"{BASE}/{ENV}", json={"private": "maybe"})).status_code == 422
        assert (await http.get(f"{BASE}/Acme/x")).status_code == 422


async def test_an_upload_over_the_limit_is_refused_before_it_is_read(open_app: FastAPI) -> None:
    async def a_gigabyte() -> AsyncIterator[bytes]:
        yield (b'--x\r\nContent-Disposition: form-data; name="files"; filename="acme_word_quiz-0.1.0-py3-none-any.whl"'
               b"\r\nContent-Type: application/octet-stream\r\n\r\n")
        for _ in range(1 << 14):
            yield b"x" * (1 << 16)

    async with client(open_app) as http:
        declared = await http.post(f"{BASE}/{ENV}/versions", content=a_gigabyte(), headers={
            "Content-Length": str(1 << 30), "Content-Type": "multipart/form-data; boundary=x"})
        assert declared.status_code == 413 and "limit of 1048576 bytes" in declared.json()["detail"], declared.text
        chunked = await http.post(f"{BASE}/{ENV}/versions", content=a_gigabyte(), headers={
            "Content-Type": "multipart/form-data; boundary=x"})
        assert chunked.status_code == 413, chunked.text
        malformed = await http.post(f"{BASE}/{ENV}/versions", content=b"not multipart at all", headers={
            "Content-Type": "multipart/form-data; boundary=x"})
        assert malformed.status_code == 422 and malformed.json()["errors"][0]["field"] == "body", malformed.text
        assert (await http.get(f"{BASE}")).json()["items"] == []


@pytest.fixture
async def tenants(keyed_app: FastAPI) -> dict[str, str]:
    bus = keyed_app.state.bus
    return {name: (await keys.create_key(bus, tenant, scopes))[0]
            for name, tenant, scopes in [("a", "acme", ["read", "write"]), ("b", "bob", ["read", "write"])]}


async def test_a_private_environment_shows_nothing_to_another_tenant(keyed_app: FastAPI,
                                                                     tenants: dict[str, str]) -> None:
    async with client(keyed_app, tenants["a"]) as a, client(keyed_app, tenants["b"]) as b, client(keyed_app) as none:
        assert (await push(a, private=True)).status_code == 201
        taken = await push(b, version="0.2.0")
        assert taken.status_code == 403 and "push under your own owner (bob/word-quiz)" in taken.json()["detail"]
        wheel_name = "acme_word_quiz-0.1.0-py3-none-any.whl"
        for method, url, body in [("GET", f"{BASE}/{ENV}", None), ("GET", f"{BASE}/{ENV}/evals", None),
                                  ("POST", f"{BASE}/{ENV}/evals", {"version": "0.1.0", "model": "m", "num_tasks": 1,
                                                                   "num_rollouts": 1}),
                                  ("PATCH", f"{BASE}/{ENV}", {"private": False}),
                                  ("GET", "/hub/simple/acme-word-quiz/", None),
                                  ("GET", f"/hub/files/{wheel_name}", None)]:
            refused = await b.request(method, url, json=body)
            if method == "PATCH":  # another owner's name: refused whether or not it exists
                assert refused.status_code == 403 and "is not API key" in refused.json()["detail"], refused.text
            else:  # as an environment that does not exist
                assert refused.status_code == 404 and "no " in refused.json()["detail"], (url, refused.text)
            anonymous = await none.request(method, url, json=body)
            assert anonymous.status_code == 401, (url, anonymous.text)
        assert (await b.get(f"{BASE}")).json()["items"] == []
        assert "acme-word-quiz" not in (await b.get("/hub/simple/")).text
        forked = await push(b, "bob/word-quiz", forked_from=f"{ENV}@0.1.0")
        assert forked.status_code == 404, forked.text  # a lineage one cannot see is not claimed
        assert (await none.get("/hub/simple/")).headers["www-authenticate"] == 'Basic realm="flywheel hub"'
        assert (await none.get(f"{BASE}")).headers["www-authenticate"] == "Bearer"

        # The owner sees it, with its key as Basic credentials too (what pip sends).
        assert (await a.get(f"{BASE}/{ENV}")).status_code == 200
        basic = await none.get("/hub/simple/acme-word-quiz/", auth=("key", tenants["a"]))
        assert basic.status_code == 200 and wheel_name in basic.text
        # Public: every tenant's key sees and evaluates it; it stays its owner's to change.
        assert (await a.patch(f"{BASE}/{ENV}", json={"private": False})).json()["private"] is False
        assert (await b.get(f"/hub/files/{wheel_name}")).status_code == 200
        assert [e["id"] for e in (await b.get(f"{BASE}")).json()["items"]] == [ENV]
        evaluated = await b.post(f"{BASE}/{ENV}/evals", json={"version": "0.1.0", "model": "m", "num_tasks": 1,
                                                               "num_rollouts": 1})
        assert evaluated.status_code == 201 and evaluated.json()["tenant"] == "bob"
        assert (await b.patch(f"{BASE}/{ENV}", json={"private": True})).status_code == 403


async def test_pip_installs_a_private_environment_from_the_index_with_the_key_alone(
        keyed_app: FastAPI, tenants: dict[str, str], tmp_path: Path) -> None:
    async with client(keyed_app, tenants["a"]) as a:
        assert (await push(a, private=True)).status_code == 201
    served = await serve(keyed_app)
    try:
        host = served.url.removeprefix("http://")

        def pip(url: str, target: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-input",
                                   "--disable-pip-version-check", "--target", str(target), "--index-url", url,
                                   "acme-word-quiz"], capture_output=True, text=True, timeout=120, check=False)

        refused = await asyncio.to_thread(pip, f"http://{host}/hub/simple/", tmp_path / "without")
        assert refused.returncode != 0 and "acme-word-quiz" in refused.stdout + refused.stderr
        other = await asyncio.to_thread(pip, f"http://key:{tenants['b']}@{host}/hub/simple/", tmp_path / "other")
        assert other.returncode != 0
        done = await asyncio.to_thread(pip, f"http://key:{tenants['a']}@{host}/hub/simple/", tmp_path / "with")
        assert done.returncode == 0, done.stdout + done.stderr
        assert (tmp_path / "with" / "acme_word_quiz" / "__init__.py").exists()
    finally:
        await served.stop()


def test_the_hub_routes_are_in_the_openapi(open_app: FastAPI) -> None:
    paths: dict[str, Any] = open_app.openapi()["paths"]
    assert {f"{BASE}", f"{BASE}/{{owner}}/{{name}}", f"{BASE}/{{owner}}/{{name}}/versions",
            f"{BASE}/{{owner}}/{{name}}/evals", "/hub/simple/", "/hub/simple/{project}/",
            "/hub/files/{filename}"} <= set(paths)
