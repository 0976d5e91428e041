"""The environment hub's storage in the trace store: environments, their immutable versions and
package files, their evals.

What a push may hold is checked before it gets here (:func:`flywheel_gateway.hub.inspect_package`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from flywheel.contract.hub import HubRefused, project_name, semver_key
from flywheel_gateway import schema as s
from flywheel_gateway.hub import Package
from flywheel_gateway.store_db import StoreBase


class HubConflict(ValueError):
    """A hub version (or package file) that exists already: versions are immutable."""


def _like_prefix(text: str) -> str:
    """``text`` with LIKE's wildcards escaped (escape character '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class HubStore(StoreBase):
    """Reads and writes the hub's tables (``hub_*``)."""

    async def hub_push(self, package: Package, owner: str, private: bool, pushed_by: str | None,
                       forked_from: str | None = None) -> dict[str, Any]:
        """Store a checked push (:func:`flywheel_gateway.hub.inspect_package`) in one transaction:
        the environment (made on its first push, owned by ``owner``), the version and its files.
        HubRefused when the environment is another tenant's; HubConflict when the version (or one
        of its file names) exists: versions are immutable. Nothing is stored then."""
        h, v, f = s.hub_environments.c, s.hub_versions.c, s.hub_files.c
        now = datetime.now(UTC)
        env_id, version = package.env_id, package.version

        def write(conn: sa.Connection) -> dict[str, Any]:
            found = conn.execute(sa.select(h.owner).where(h.id == env_id)).first()
            if found is None:
                project = project_name(env_id)
                same = conn.execute(sa.select(h.id).where(h.project == project)).scalar()
                if same is not None:
                    raise HubRefused(f"environment {env_id!r}: its package name {project!r} is {same!r}'s already "
                                     "(names are compared with '-', '_' and '.' alike); choose another name")
                conn.execute(sa.insert(s.hub_environments).values(id=env_id, owner=owner, project=project,
                                                                   private=private, forked_from=forked_from,
                                                                   created_at=now))
            elif found.owner != owner:
                raise HubRefused(f"environment {env_id!r} belongs to tenant {found.owner!r}; push it under an "
                                 f"owner of your own (fork it: {owner}/<name>)")
            if conn.execute(sa.select(v.version).where(v.env_id == env_id, v.version == version)).first():
                raise HubConflict(f"{env_id}@{version} exists: a pushed version never changes; push a new version")
            names = [file.filename for file in package.files]
            taken = conn.execute(sa.select(f.filename).where(f.filename.in_(names))).scalars().all()
            if taken:
                raise HubConflict(f"file {taken[0]} exists on the hub; push a new version")
            conn.execute(sa.insert(s.hub_versions).values(
                env_id=env_id, version=version, sha256=package.sha256, summary=package.summary,
                readme=package.readme, pushed_by=pushed_by, created_at=now))
            conn.execute(sa.insert(s.hub_files), [
                {"filename": file.filename, "env_id": env_id, "version": version, "kind": file.kind,
                 "sha256": file.sha256, "size_bytes": len(file.data), "data": file.data} for file in package.files])
            return {"env_id": env_id, "version": version, "sha256": package.sha256, "created_at": now}

        try:
            return await self._write(write)
        except sa.exc.IntegrityError as exc:  # the same version pushed at the same moment
            raise HubConflict(f"{env_id}@{version} exists: a pushed version never changes; push a new "
                              "version") from exc

    async def hub_environment(self, env_id: str) -> dict[str, Any] | None:
        """An environment of the hub with its versions (newest first) and their files (no content);
        None when there is none of that id."""
        h, v, f = s.hub_environments.c, s.hub_versions.c, s.hub_files.c
        async with self.engine.connect() as conn:
            env = (await conn.execute(sa.select(s.hub_environments).where(h.id == env_id))).mappings().first()
            if env is None:
                return None
            versions = [dict(row) for row in (await conn.execute(
                sa.select(v.version, v.sha256, v.summary, v.readme, v.pushed_by, v.created_at)
                .where(v.env_id == env_id))).mappings()]
            files = (await conn.execute(sa.select(f.filename, f.version, f.kind, f.sha256, f.size_bytes)
                                        .where(f.env_id == env_id).order_by(f.filename))).mappings().all()
            forks = (await conn.execute(sa.select(h.id, h.owner, h.private, h.forked_from)
                                        .where(h.forked_from.like(f"{_like_prefix(env_id)}@%", escape="\\"))
                                        .order_by(h.id))).mappings().all()
        for version in versions:
            version["files"] = [{k: row[k] for k in ("filename", "kind", "sha256", "size_bytes")}
                                for row in files if row["version"] == version["version"]]
        versions.sort(key=lambda row: semver_key(row["version"]), reverse=True)
        return {**env, "versions": versions, "forks": [dict(row) for row in forks]}

    async def hub_environments(self, viewer: str | None) -> list[dict[str, Any]]:
        """The hub's environments ``viewer`` may see (the public ones and its own; None: every
        one), by id, each with its newest version."""
        h, v = s.hub_environments.c, s.hub_versions.c
        query = sa.select(s.hub_environments).order_by(h.id)
        if viewer is not None:
            query = query.where(sa.or_(h.private.is_(False), h.owner == viewer))
        async with self.engine.connect() as conn:
            envs = [dict(row) for row in (await conn.execute(query)).mappings()]
            versions = (await conn.execute(sa.select(v.env_id, v.version, v.summary).where(
                v.env_id.in_([env["id"] for env in envs])))).mappings().all()
        newest: dict[str, dict[str, Any]] = {}
        for row in versions:
            key = semver_key(row["version"])
            if row["env_id"] not in newest or key > newest[row["env_id"]]["key"]:
                newest[row["env_id"]] = {"key": key, "version": row["version"], "summary": row["summary"]}
        return [{**env, "latest_version": newest.get(env["id"], {}).get("version"),
                 "summary": newest.get(env["id"], {}).get("summary", "")} for env in envs]

    async def hub_project(self, project: str) -> dict[str, Any] | None:
        """The environment whose package is ``project`` (normalized), with every file of every
        version (no content); None when there is none."""
        h, f = s.hub_environments.c, s.hub_files.c
        async with self.engine.connect() as conn:
            env = (await conn.execute(sa.select(s.hub_environments).where(h.project == project))).mappings().first()
            if env is None:
                return None
            files = (await conn.execute(sa.select(f.filename, f.version, f.kind, f.sha256, f.size_bytes)
                                        .where(f.env_id == env["id"]).order_by(f.filename))).mappings().all()
        return {**env, "files": [dict(row) for row in files]}

    async def hub_file(self, filename: str) -> dict[str, Any] | None:
        """A package file with its content and its environment's owner and visibility; None when
        the hub has no file of that name."""
        h, f = s.hub_environments.c, s.hub_files.c
        query = (sa.select(f.filename, f.env_id, f.version, f.kind, f.sha256, f.size_bytes, f.data, h.owner, h.private)
                 .join_from(s.hub_files, s.hub_environments, h.id == f.env_id).where(f.filename == filename))
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return dict(row) if row is not None else None

    async def hub_set_private(self, env_id: str, private: bool) -> bool:
        """Make an environment private or public; False when there is none of that id."""
        h = s.hub_environments.c

        def write(conn: sa.Connection) -> bool:
            return conn.execute(sa.update(s.hub_environments).where(h.id == env_id)
                                .values(private=private)).rowcount > 0

        return await self._write(write)

    async def hub_add_eval(self, env_id: str, version: str, figures: dict[str, Any], tenant: str,
                           pushed_by: str | None) -> dict[str, Any]:
        """Attach an eval to a version of an environment: a row of its leaderboard. ``figures``:
        the ``hub_evals`` columns an eval fills (model, reward_mean, reward_stderr, pass_at,
        num_tasks, num_rollouts, prompt_tokens, completion_tokens, summary). LookupError when the
        version is not on the hub."""
        v = s.hub_versions.c
        row = {**figures, "env_id": env_id, "version": version, "tenant": tenant, "pushed_by": pushed_by,
               "created_at": datetime.now(UTC)}

        def write(conn: sa.Connection) -> dict[str, Any]:
            if conn.execute(sa.select(v.version).where(v.env_id == env_id, v.version == version)).first() is None:
                raise LookupError(f"{env_id}@{version} is not on the hub")
            key = conn.execute(sa.insert(s.hub_evals).values(**row)).inserted_primary_key
            assert key is not None  # an INSERT of one row has its primary key
            return {"id": key[0], **row}

        return await self._write(write)

    async def hub_evals(self, env_id: str, version: str | None = None) -> list[dict[str, Any]]:
        """The evals pushed to an environment (one version's, when given): best reward first."""
        e = s.hub_evals.c
        query = sa.select(s.hub_evals).where(e.env_id == env_id)
        if version is not None:
            query = query.where(e.version == version)
        query = query.order_by(e.reward_mean.desc().nulls_last(), e.created_at)
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]
