"""The environment hub's packages: what a pushed version must hold, checked before anything is stored.

An environment on the hub is ``owner/name`` (the owner is a tenant; :mod:`flywheel.contract.hub`
has the names); its package is a Python distribution named ``owner-name`` (so ``pip install
--index-url <gateway>/hub/simple owner-name`` finds it by the standard simple API) that
registers ``owner/name`` under the ``flywheel.environments`` entry points (so a run config's
``env = "owner/name"`` resolves once it is installed). A version is semantic
(``MAJOR.MINOR.PATCH``), which is also a valid Python version, and is immutable once pushed:
its content hash is the wheel's sha256.

:func:`inspect_package` reads a push: exactly one wheel and at most one sdist of that project
and version, each no larger than ``max_file_bytes``, checked by the rules of
:mod:`flywheel.contract.hubpackage` (the same ones ``flywheel env push`` applies before
uploading and the hub client before installing): a pure-Python wheel tagged ``py3-none-any``
that installs its own modules and nothing else (no ``.pth``, no ``.data/`` folder, no entry
point outside ``flywheel.environments``, a RECORD that matches), sizes capped after
decompression and counted while inflating in chunks; the sdist is kept for reading and never
installed. Refusals name the file, the member and the rule. Nothing is unpacked to disk.

Storage (:class:`flywheel_gateway.store.Store`, ``hub_*`` tables): package files sit in the
trace store's database beside their metadata, so a push is one transaction (a refused push
stores nothing; a version never lacks its files) and a backup of the database is a backup of
the hub. Environment packages are small (kilobytes to a few megabytes; ``max_file_bytes``
bounds them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from flywheel.contract.hub import HubRefused, check_env_id, check_version
from flywheel.contract.hubpackage import check_sdist, check_wheel


@dataclass(frozen=True)
class PackageFile:
    filename: str
    kind: str  # wheel, sdist
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class Package:
    """A checked push: the environment, its version, what its metadata says, its files."""

    env_id: str
    version: str
    summary: str
    readme: str
    files: list[PackageFile]

    @property
    def sha256(self) -> str:
        """The version's content hash: its wheel's sha256."""
        return next(f.sha256 for f in self.files if f.kind == "wheel")


def inspect_package(env_id: str, version: str, files: Mapping[str, bytes], max_file_bytes: int) -> Package:
    """The push of ``files`` (file name -> content) as version ``version`` of ``env_id``, checked
    as the module says; HubRefused naming the file and the fix otherwise."""
    check_env_id(env_id)
    check_version(version)
    kinds: dict[str, str] = {}
    for filename, data in files.items():
        if len(data) > max_file_bytes:
            raise HubRefused(f"{filename}: {len(data)} bytes, over the hub's limit of {max_file_bytes} a file")
        if filename.endswith(".whl"):
            kinds[filename] = "wheel"
        elif filename.endswith(".tar.gz"):
            kinds[filename] = "sdist"
        else:
            raise HubRefused(f"{filename}: not a wheel (.whl) or an sdist (.tar.gz); push what `python -m build` "
                             "writes")
    counts = [list(kinds.values()).count(kind) for kind in ("wheel", "sdist")]
    if counts[0] != 1 or counts[1] > 1:
        raise HubRefused(f"a push holds one wheel and at most one sdist; this one holds {counts[0]} wheel(s) and "
                         f"{counts[1]} sdist(s) (the hub installs wheels alone and never builds an sdist)")
    summary, readme = "", ""
    for filename, kind in kinds.items():
        if kind == "wheel":
            wheel = check_wheel(filename, files[filename], env_id, version)
            summary, readme = wheel.summary, wheel.readme
        else:
            check_sdist(filename, files[filename], env_id, version)
    return Package(env_id, version, summary, readme, [PackageFile(f, kind, files[f]) for f, kind in kinds.items()])
