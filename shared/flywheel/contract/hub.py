"""Names on the environment hub, shared by the gateway's hub and the clients that push to it.

An environment on the hub is ``owner/name``: the owner is a tenant, and both parts are
lower-case letters, digits, '-' and '_', starting with a letter. Its package is the Python
distribution ``owner-name`` (:func:`project_name`), which registers ``owner/name`` under the
``flywheel.environments`` entry points. A version is semantic, ``MAJOR.MINOR.PATCH``.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

ENTRY_POINT_GROUP = "flywheel.environments"
SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")
ENV_PART = re.compile(r"[a-z][a-z0-9_-]{0,63}")


class HubRefused(ValueError):
    """A push, or an environment id, the hub does not take; the message names what and why."""


def check_env_id(env_id: str) -> tuple[str, str]:
    """``owner/name`` split in two; HubRefused naming the id when it is not one."""
    owner, slash, name = env_id.partition("/")
    if not slash or not ENV_PART.fullmatch(owner) or not ENV_PART.fullmatch(name):
        raise HubRefused(f"environment id {env_id!r}: an id is owner/name, each part lower-case letters, digits, "
                         "'-' and '_', starting with a letter (at most 64 characters)")
    return owner, name


def check_version(version: str) -> str:
    if not SEMVER.fullmatch(version):
        raise HubRefused(f"version {version!r}: a hub version is MAJOR.MINOR.PATCH (e.g. 0.1.0)")
    return version


def project_name(env_id: str) -> str:
    """The distribution an environment's package must be: ``owner-name``, normalized (PEP 503)."""
    owner, name = check_env_id(env_id)
    return canonicalize_name(f"{owner}-{name}")


def semver_key(version: str) -> tuple[int, ...]:
    """A hub version (MAJOR.MINOR.PATCH) as numbers, to sort by."""
    return tuple(int(part) for part in version.split("."))
