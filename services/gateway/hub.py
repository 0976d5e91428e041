"""The environment hub's packages: what a pushed version must hold, checked before anything is stored.

An environment on the hub is ``owner/name`` (the owner is a tenant; :mod:`flywheel.contract.hub`
has the names); its package is a Python distribution named ``owner-name`` (so ``pip install
--index-url <gateway>/hub/simple owner-name`` finds it by the standard simple API) that
registers ``owner/name`` under the ``flywheel.environments`` entry points (so a run config's
``env = "owner/name"`` resolves once it is installed). A version is semantic
(``MAJOR.MINOR.PATCH``), which is also a valid Python version, and is immutable once pushed:
its content hash is the wheel's sha256.

:func:`inspect_package` reads a push: exactly one wheel and at most one sdist of that project
and version. It refuses, naming the file and what to fix, a file name that is not a wheel's
or an sdist's, a project or version that is not the environment's, a version that is not
semantic, an archive that does not open, a member whose path leaves the archive's root (an
absolute path, ``..``, or a link pointing out), a wheel without its metadata or without the
entry point, and a file over ``max_file_bytes``. Nothing is unpacked to disk: the archives are
read in memory.

Storage (:class:`flywheel_gateway.store.Store`, ``hub_*`` tables): package files sit in the
trace store's database beside their metadata, so a push is one transaction (a refused push
stores nothing; a version never lacks its files) and a backup of the database is a backup of
the hub. Environment packages are small (kilobytes to a few megabytes; ``max_file_bytes``
bounds them).
"""

from __future__ import annotations

import configparser
import hashlib
import io
import re
import tarfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import PurePosixPath

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)

from flywheel.contract.hub import ENTRY_POINT_GROUP, HubRefused, check_version, project_name


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
    project = project_name(env_id)
    check_version(version)
    checked: list[PackageFile] = []
    summary, readme = "", ""
    for filename, data in files.items():
        if len(data) > max_file_bytes:
            raise HubRefused(f"{filename}: {len(data)} bytes, over the hub's limit of {max_file_bytes} a file")
        if filename.endswith(".whl"):
            _check_name(filename, project, version, *_wheel_name(filename))
            summary, readme = _check_wheel(filename, data, env_id)
            checked.append(PackageFile(filename, "wheel", data))
        elif filename.endswith(".tar.gz"):
            _check_name(filename, project, version, *_sdist_name(filename))
            _check_sdist(filename, data, filename.removesuffix(".tar.gz"))
            checked.append(PackageFile(filename, "sdist", data))
        else:
            raise HubRefused(f"{filename}: not a wheel (.whl) or an sdist (.tar.gz); push what `python -m build` "
                             "writes")
    kinds = [f.kind for f in checked]
    if kinds.count("wheel") != 1 or kinds.count("sdist") > 1:
        raise HubRefused(f"a push holds one wheel and at most one sdist; this one holds {kinds.count('wheel')} "
                         f"wheel(s) and {kinds.count('sdist')} sdist(s)")
    return Package(env_id, version, summary, readme, checked)


def _wheel_name(filename: str) -> tuple[str, str]:
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except InvalidWheelFilename as exc:
        raise HubRefused(f"{filename}: not a wheel's file name ({exc})") from None
    return name, str(version)


def _sdist_name(filename: str) -> tuple[str, str]:
    try:
        name, version = parse_sdist_filename(filename)
    except InvalidSdistFilename as exc:
        raise HubRefused(f"{filename}: not an sdist's file name ({exc})") from None
    return name, str(version)


def _check_name(filename: str, project: str, version: str, its_project: str, its_version: str) -> None:
    if canonicalize_name(its_project) != project:
        raise HubRefused(f"{filename}: the distribution is {its_project!r}; this environment's is {project!r} "
                         f"(set [project] name = \"{project}\" in pyproject.toml)")
    if its_version != version:
        raise HubRefused(f"{filename}: version {its_version}, not the pushed {version} (set [project] version)")


def _inside(member: str, root: str | None = None) -> bool:
    """Whether an archive member's path stays in the archive (under ``root``, when given)."""
    path = PurePosixPath(member.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or re.match(r"[A-Za-z]:", member):
        return False
    return root is None or (path.parts[:1] == (root,))


def _check_wheel(filename: str, data: bytes, env_id: str) -> tuple[str, str]:
    """The wheel's summary and README (its metadata's description); HubRefused when it does not open,
    a member leaves it, its metadata is missing, or it does not register ``env_id``."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise HubRefused(f"{filename}: does not open as a wheel (a zip archive): {exc}") from None
    escaping = [n for n in names if not _inside(n)]
    if escaping:
        raise HubRefused(f"{filename}: member {escaping[0]!r} leaves the archive's root; rebuild the wheel")
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    if len(dist_info) != 1:
        raise HubRefused(f"{filename}: holds {len(dist_info)} .dist-info folders, a wheel has one")
    (info,) = dist_info
    try:
        metadata = HeaderParser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names \
            else ""
    except (KeyError, UnicodeDecodeError) as exc:
        raise HubRefused(f"{filename}: its metadata does not read ({exc}); rebuild the wheel") from None
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # entry-point names keep their case
    try:
        parser.read_string(entry_points)
    except configparser.Error as exc:
        raise HubRefused(f"{filename}: entry_points.txt does not parse: {exc}") from None
    registered = dict(parser[ENTRY_POINT_GROUP]) if parser.has_section(ENTRY_POINT_GROUP) else {}
    if env_id not in registered:
        raise HubRefused(f"{filename}: registers {sorted(registered) or 'no environment'} under the "
                         f"{ENTRY_POINT_GROUP!r} entry points, not {env_id!r}; add to pyproject.toml: "
                         f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"] \"{env_id}\" = \"<module>:load_environment\"")
    description = metadata.get_payload()
    readme = description if isinstance(description, str) else ""
    return str(metadata.get("Summary", "")), readme.strip()


def _check_sdist(filename: str, data: bytes, root: str) -> None:
    """HubRefused when the sdist does not open, or a member (or a link's target) leaves ``root``."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            members = archive.getmembers()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise HubRefused(f"{filename}: does not open as an sdist (a .tar.gz archive): {exc}") from None
    for member in members:
        if not _inside(member.name, root):
            raise HubRefused(f"{filename}: member {member.name!r} is not under {root}/; rebuild the sdist")
        if member.issym() or member.islnk():
            target = member.linkname if member.islnk() else str(PurePosixPath(member.name).parent / member.linkname)
            if not _inside(target, root):
                raise HubRefused(f"{filename}: link {member.name!r} points out of the archive ({member.linkname!r})")
        elif not (member.isfile() or member.isdir()):
            raise HubRefused(f"{filename}: member {member.name!r} is not a file or a folder")
    if f"{root}/PKG-INFO" not in {m.name for m in members}:
        raise HubRefused(f"{filename}: has no {root}/PKG-INFO; rebuild the sdist")
