"""What a package on the environment hub may hold: the rules the gateway applies to a push,
``flywheel env push`` to what it built before uploading, and the hub client to a wheel before
installing it (so a version stored before a rule existed is refused too).

The threat is the publisher. Installing a hub package must run none of its code: loading the
environment later runs the package's own modules (in the environment's worker), and nothing
else of it runs, at install time or at any interpreter start. So a package is one wheel,
tagged ``py3-none-any`` alone (pip picks it on every Python 3, and never falls back to
building an sdist, which runs the sdist's build backend), that installs its own modules into
site-packages and nothing else:

- no ``.pth`` file anywhere (site-packages' ``.pth`` lines run at every interpreter start),
  and no ``sitecustomize`` or ``usercustomize`` module (the same);
- no ``<name>.data/`` folder: ``scripts/`` become commands on the PATH, ``headers/`` and
  ``data/`` land outside site-packages (``data/`` anywhere under the environment's prefix,
  ``bin/python`` included), ``purelib/`` and ``platlib/`` would be checked by other rules
  than the wheel's root;
- no other distribution's metadata (``*.dist-info``, ``*.egg-info``, ``*.egg-link``) and no
  module of the platform's own (``flywheel``, ``flywheel_*``);
- entry points in the ``flywheel.environments`` group alone, registering exactly its own
  environment with one of its own modules (no ``console_scripts``, no other tool's plugins);
- dependencies by name and version only (a direct reference, ``name @ URL``, could point pip
  at an sdist);
- a RECORD that lists every member with its sha256 and size, and nothing else.

Sizes are capped after decompression, counted while each member is inflated in chunks of
``READ_CHUNK_BYTES`` (never a member whole in memory, so a small archive that inflates to
gigabytes costs its reader a chunk, not its memory): ``MAX_METADATA_BYTES`` for METADATA and
every other ``.dist-info`` file (an sdist's PKG-INFO too), ``MAX_README_BYTES`` for the
description (the README the hub shows), ``MAX_MEMBER_BYTES`` for any other member,
``MAX_TOTAL_BYTES`` for a whole archive, ``MAX_MEMBERS`` members an archive. Errors name the
file, the member and the limit.

An sdist may come with the wheel, for reading (``flywheel env fork`` copies its source); it is
checked for paths that leave its root, links out of it, and the same sizes, and no install
path builds it.
"""

from __future__ import annotations

import base64
import configparser
import csv
import gzip
import hashlib
import io
import json
import re
import tarfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)

from flywheel.contract.hub import ENTRY_POINT_GROUP, HubRefused, check_version, project_name

PURE_TAG = "py3-none-any"
MAX_MEMBERS = 5_000  # files in one wheel or sdist
MAX_METADATA_BYTES = 1 << 20  # METADATA (the README in it), any other .dist-info file, an sdist's PKG-INFO
MAX_README_BYTES = 512 << 10  # the description in METADATA: the README the hub shows
MAX_MEMBER_BYTES = 32 << 20  # any other file, decompressed
MAX_TOTAL_BYTES = 128 << 20  # every file of one archive together, decompressed
READ_CHUNK_BYTES = 1 << 16  # what is inflated at a time

START_HOOKS = ("sitecustomize", "usercustomize")  # modules Python imports at every start
DATA_FOLDERS = {
    "scripts": "as commands on the environment's PATH",
    "headers": "as C headers, outside site-packages",
    "data": "anywhere under the environment's prefix (its bin/ included)",
    "purelib": "into site-packages, past the rules on the wheel's root",
    "platlib": "into site-packages, past the rules on the wheel's root",
}
_CD_SIGNATURE = b"PK\x01\x02"  # every member of a zip archive has one central directory record


@dataclass(frozen=True)
class Wheel:
    """A checked wheel: what its metadata says and what it installs."""

    summary: str
    readme: str
    requires: list[str]  # Requires-Dist, as written
    modules: list[str]  # the top-level modules and packages it installs
    files: list[str]  # the paths it installs, relative to site-packages (its RECORD's)


def check_wheel(filename: str, data: bytes, env_id: str, version: str) -> Wheel:
    """``data``, the wheel ``filename`` of version ``version`` of ``env_id``, checked as the
    module says; HubRefused naming the file, the member and the rule otherwise."""
    project = project_name(env_id)
    check_version(version)
    try:
        name, its_version, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename as exc:
        raise HubRefused(f"{filename}: not a wheel's file name ({exc})") from None
    _check_name(filename, project, version, name, str(its_version))
    if {str(tag) for tag in tags} != {PURE_TAG}:
        raise HubRefused(f"{filename}: tagged {'.'.join(sorted(str(t) for t in tags))}; the hub takes pure-Python "
                         f"wheels tagged {PURE_TAG} alone, which every installer picks, so none falls back to "
                         "building an sdist (a pure-Python package with no `universal` wheel setting builds one)")
    archive = _open_zip(filename, data)
    infos = archive.infolist()
    names = [info.filename for info in infos]
    seen: set[str] = set()
    for member in names:
        if member in seen:
            raise HubRefused(f"{filename}: member {member!r} is in the archive twice; rebuild the wheel")
        seen.add(member)
    info_dir = _dist_info(filename, names, project, version)
    for member in names:
        _check_path(filename, member, info_dir)
    files = [info for info in infos if not info.is_dir()]
    contents, digests = _read_members(filename, archive, files, info_dir)
    record_path = f"{info_dir}/RECORD"
    for wanted in (f"{info_dir}/METADATA", f"{info_dir}/WHEEL", record_path):
        if wanted not in contents:
            raise HubRefused(f"{filename}: has no {wanted}; rebuild the wheel")
    _check_record(filename, _text(filename, record_path, contents), record_path, digests)
    _check_wheel_file(filename, _text(filename, f"{info_dir}/WHEEL", contents))
    modules = sorted({_module(m) for m in digests if not m.startswith(f"{info_dir}/")})
    entry_points = f"{info_dir}/entry_points.txt"
    _check_entry_points(filename, _text(filename, entry_points, contents) if entry_points in contents else "",
                        env_id, modules)
    summary, readme, requires = _check_metadata(filename, _text(filename, f"{info_dir}/METADATA", contents),
                                                project, version)
    return Wheel(summary, readme, requires, modules, sorted(digests))


def check_sdist(filename: str, data: bytes, env_id: str, version: str) -> None:
    """HubRefused when the sdist is not of ``env_id``'s ``version``, does not open, holds a
    member (or a link's target) outside its root folder or anything but files and folders, goes
    over a size, or lacks its PKG-INFO."""
    project = project_name(env_id)
    try:
        name, its_version = parse_sdist_filename(filename)
    except InvalidSdistFilename as exc:
        raise HubRefused(f"{filename}: not an sdist's file name ({exc})") from None
    _check_name(filename, project, version, name, str(its_version))
    root = filename.removesuffix(".tar.gz")
    stream = _Capped(gzip.GzipFile(fileobj=io.BytesIO(data)), filename)
    found_pkg_info = False
    try:
        # "r|": read as a stream, through the cap, never seeking; each member's data is skipped
        # by reading it, so every byte inflated is counted.
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_SmallHeaders) as archive:
            for count, member in enumerate(archive, start=1):
                if count > MAX_MEMBERS:
                    raise HubRefused(f"{filename}: more than {MAX_MEMBERS} members (MAX_MEMBERS)")
                _check_sdist_member(filename, member, root)
                found_pkg_info |= member.name == f"{root}/PKG-INFO"
    except _LargeHeader as exc:
        raise HubRefused(f"{filename}: {exc}") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise HubRefused(f"{filename}: does not open as an sdist (a .tar.gz archive): {exc}") from None
    if not found_pkg_info:
        raise HubRefused(f"{filename}: has no {root}/PKG-INFO; rebuild the sdist")


def _check_name(filename: str, project: str, version: str, its_project: str, its_version: str) -> None:
    """HubRefused unless a file's distribution and version are the environment's."""
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


# --- the wheel's parts ------------------------------------------------------------------------


def _open_zip(filename: str, data: bytes) -> zipfile.ZipFile:
    # Counted before the central directory is parsed: a ZipInfo a record costs memory, and a
    # small archive can hold hundreds of thousands of empty records.
    if data.count(_CD_SIGNATURE) > MAX_MEMBERS:
        raise HubRefused(f"{filename}: more than {MAX_MEMBERS} members (MAX_MEMBERS)")
    try:
        return zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise HubRefused(f"{filename}: does not open as a wheel (a zip archive): {exc}") from None


def _dist_info(filename: str, names: list[str], project: str, version: str) -> str:
    folders = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    if len(folders) != 1:
        raise HubRefused(f"{filename}: holds {len(folders)} .dist-info folders, a wheel has one")
    (folder,) = folders
    its_name, _, its_version = folder.removesuffix(".dist-info").rpartition("-")
    if canonicalize_name(its_name) != project or its_version != version:
        raise HubRefused(f"{filename}: its metadata folder is {folder!r}, not {project}-{version}'s; rebuild the "
                         "wheel")
    return folder


def _check_path(filename: str, member: str, info_dir: str) -> None:
    """HubRefused when a member's path is one a hub wheel may not install (the module says which)."""
    if not _inside(member):
        raise HubRefused(f"{filename}: member {member!r} leaves the archive's root; rebuild the wheel")
    parts = PurePosixPath(member).parts
    top = parts[0]
    if top.endswith(".data"):
        kind = parts[1] if len(parts) > 1 else ""
        where = DATA_FOLDERS.get(kind, "outside the package")
        raise HubRefused(f"{filename}: member {member!r} is in {top}/, which pip installs {where}; a hub wheel "
                         "installs its own modules alone (no scripts, headers, data files or purelib/platlib "
                         "folders: move data into the package and read it with importlib.resources)")
    if any(p.lower().endswith(".pth") for p in parts):
        raise HubRefused(f"{filename}: member {member!r} is a .pth file, whose lines Python runs at every start of "
                         "the environment it is installed in; the hub takes no .pth file")
    stem = top.split(".")[0]
    if stem in START_HOOKS:
        raise HubRefused(f"{filename}: member {member!r} is a {stem} module, which Python imports at every start; "
                         "the hub takes none")
    if stem == "flywheel" or stem.startswith("flywheel_"):
        raise HubRefused(f"{filename}: member {member!r}: flywheel and flywheel_* are the platform's own modules; "
                         "name yours otherwise")
    if top != info_dir and top.endswith((".dist-info", ".egg-info", ".egg-link", ".egg")):
        raise HubRefused(f"{filename}: member {member!r} is another distribution's metadata, which would register "
                         "entry points or a package beside this one; rebuild the wheel")


def _module(member: str) -> str:
    """The top-level module or package a member belongs to (``qa/x.py`` -> qa, ``util.py`` -> util)."""
    top = PurePosixPath(member).parts[0]
    return top if "/" in member else top.split(".")[0]


def _read_members(filename: str, archive: zipfile.ZipFile, files: list[zipfile.ZipInfo],
                  info_dir: str) -> tuple[dict[str, bytes], dict[str, tuple[str, int]]]:
    """Inflate every member in chunks, counting as it goes: (the .dist-info files' contents,
    member -> (its RECORD-style sha256, its size)); HubRefused at the first limit passed."""
    def limit(member: str) -> tuple[int, str]:
        metadata = member.startswith(f"{info_dir}/")
        cap, what = (MAX_METADATA_BYTES, "MAX_METADATA_BYTES") if metadata else (MAX_MEMBER_BYTES, "MAX_MEMBER_BYTES")
        return cap, (f"{filename}: member {member!r} inflates to more than {cap} bytes, the hub's limit for "
                     f"{'a .dist-info file' if metadata else 'one file'} ({what})")

    # The sizes the archive declares, first: a bomb that says what it is is refused before
    # anything is inflated. What inflating gives is counted below all the same.
    for info in files:
        if info.file_size > limit(info.filename)[0]:
            raise HubRefused(limit(info.filename)[1])
    total = sum(info.file_size for info in files)
    if total > MAX_TOTAL_BYTES:
        raise HubRefused(f"{filename}: its members inflate to {total} bytes, over the hub's limit of "
                         f"{MAX_TOTAL_BYTES} an archive (MAX_TOTAL_BYTES)")
    contents: dict[str, bytes] = {}
    digests: dict[str, tuple[str, int]] = {}
    total = 0
    for info in files:
        member = info.filename
        metadata = member.startswith(f"{info_dir}/")
        cap, over = limit(member)
        if info.flag_bits & 0x1:
            raise HubRefused(f"{filename}: member {member!r} is encrypted; rebuild the wheel")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise HubRefused(f"{filename}: member {member!r} is compressed with method {info.compress_type}; a "
                             "wheel's members are stored or deflated")
        digest, size, chunks = hashlib.sha256(), 0, []
        try:
            with archive.open(info) as stream:
                while chunk := stream.read(READ_CHUNK_BYTES):
                    size += len(chunk)
                    total += len(chunk)
                    if size > cap:
                        raise HubRefused(over)
                    if total > MAX_TOTAL_BYTES:
                        raise HubRefused(f"{filename}: its members inflate to more than {MAX_TOTAL_BYTES} bytes "
                                         f"(at {member!r}), the hub's limit an archive (MAX_TOTAL_BYTES)")
                    digest.update(chunk)
                    if metadata:
                        chunks.append(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError, RuntimeError) as exc:
            raise HubRefused(f"{filename}: member {member!r} does not read: {exc}") from None
        digests[member] = ("sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode(), size)
        if metadata:
            contents[member] = b"".join(chunks)
    return contents, digests


def _text(filename: str, member: str, contents: dict[str, bytes]) -> str:
    try:
        return contents[member].decode()
    except UnicodeDecodeError as exc:
        raise HubRefused(f"{filename}: {member} is not UTF-8 text ({exc}); rebuild the wheel") from None


def _check_record(filename: str, text: str, record_path: str, digests: dict[str, tuple[str, int]]) -> None:
    """HubRefused unless RECORD lists every member but itself once, with its sha256 and size,
    and nothing the wheel does not hold."""
    listed: dict[str, tuple[str, str]] = {}
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise HubRefused(f"{filename}: {record_path} does not parse ({exc}); rebuild the wheel") from None
    for row in rows:
        if not row:
            continue
        if len(row) != 3:
            raise HubRefused(f"{filename}: {record_path} has a line of {len(row)} fields, not 3: {row[:3]!r}")
        if row[0] in listed:
            raise HubRefused(f"{filename}: {record_path} lists {row[0]!r} twice")
        listed[row[0]] = (row[1], row[2])
    for member, (digest, size) in digests.items():
        if member == record_path:
            continue
        if member not in listed:
            raise HubRefused(f"{filename}: member {member!r} is not in {record_path}; rebuild the wheel")
        if listed[member] != (digest, str(size)):
            raise HubRefused(f"{filename}: member {member!r} does not match its line in {record_path} (its sha256 "
                             f"is {digest}, size {size}; the line says {listed[member][0] or 'none'}, size "
                             f"{listed[member][1] or 'none'}); rebuild the wheel")
    extra = sorted(set(listed) - set(digests))
    if extra:
        raise HubRefused(f"{filename}: {record_path} lists {extra[0]!r}, which the wheel does not hold; rebuild the "
                         "wheel")


def _check_wheel_file(filename: str, text: str) -> None:
    headers = HeaderParser().parsestr(text)
    if not str(headers.get("Wheel-Version", "")).startswith("1."):
        raise HubRefused(f"{filename}: WHEEL says Wheel-Version {headers.get('Wheel-Version')!r}; the hub reads 1.x")
    if str(headers.get("Root-Is-Purelib", "")).strip().lower() != "true":
        raise HubRefused(f"{filename}: WHEEL says Root-Is-Purelib {headers.get('Root-Is-Purelib')!r}; a hub wheel "
                         "is pure Python (true)")
    tags = [str(t).strip() for t in headers.get_all("Tag") or []]
    if not tags or set(tags) != {PURE_TAG}:
        raise HubRefused(f"{filename}: WHEEL says Tag {', '.join(tags) or 'nothing'}; a hub wheel is {PURE_TAG} "
                         "alone")


def _check_entry_points(filename: str, text: str, env_id: str, modules: list[str]) -> None:
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # entry-point names keep their case
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        raise HubRefused(f"{filename}: entry_points.txt does not parse: {exc}") from None
    others = [group for group in parser.sections() if group != ENTRY_POINT_GROUP]
    if others:
        raise HubRefused(f"{filename}: declares entry points of the group {others[0]!r} "
                         f"({', '.join(parser[others[0]]) or 'none'}); a hub package declares "
                         f"{ENTRY_POINT_GROUP!r} alone (no console_scripts, gui_scripts or plugins of other tools): "
                         "remove [project.scripts], [project.gui-scripts] and other [project.entry-points] tables")
    registered = dict(parser[ENTRY_POINT_GROUP]) if parser.has_section(ENTRY_POINT_GROUP) else {}
    if list(registered) != [env_id]:
        raise HubRefused(f"{filename}: registers {sorted(registered) or 'no environment'} under the "
                         f"{ENTRY_POINT_GROUP!r} entry points, not {env_id!r} alone; pyproject.toml has: "
                         f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"] \"{env_id}\" = \"<module>:load_environment\"")
    target = registered[env_id].strip()
    module = target.split(":")[0].strip().split(".")[0]
    if module not in modules:
        raise HubRefused(f"{filename}: {env_id!r} is registered as {target!r}, but the wheel holds no module "
                         f"{module!r} (its modules: {', '.join(modules) or 'none'})")


def _check_metadata(filename: str, text: str, project: str, version: str) -> tuple[str, str, list[str]]:
    metadata = HeaderParser().parsestr(text)
    if canonicalize_name(str(metadata.get("Name", ""))) != project or str(metadata.get("Version", "")) != version:
        raise HubRefused(f"{filename}: METADATA names {metadata.get('Name')!r} {metadata.get('Version')!r}, not "
                         f"{project} {version}; rebuild the wheel")
    payload = metadata.get_payload()
    readme = (payload if isinstance(payload, str) and payload.strip() else str(metadata.get("Description", ""))).strip()
    if len(readme.encode()) > MAX_README_BYTES:
        raise HubRefused(f"{filename}: its description (the README) is {len(readme.encode())} bytes, over the hub's "
                         f"limit of {MAX_README_BYTES} (MAX_README_BYTES); shorten README.md")
    requires = [str(r) for r in metadata.get_all("Requires-Dist") or []]
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement as exc:
            raise HubRefused(f"{filename}: Requires-Dist {line!r} does not parse ({exc})") from None
        if requirement.url:
            raise HubRefused(f"{filename}: Requires-Dist {line!r} is a direct reference (name @ URL), which could "
                             "make pip build an sdist; name dependencies by version, for the installer's index")
    return str(metadata.get("Summary", "")), readme, requires


# --- the sdist ------------------------------------------------------------------------------


class _Capped(io.RawIOBase):
    """A decompressing stream that refuses to give more than ``MAX_TOTAL_BYTES`` in all, read
    at most ``READ_CHUNK_BYTES`` at a time from the decompressor."""

    def __init__(self, stream: gzip.GzipFile, filename: str) -> None:
        self.stream, self.filename, self.total = stream, filename, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, wanted = [], size if size >= 0 else MAX_TOTAL_BYTES + 1
        while wanted > 0:
            chunk = self.stream.read(min(wanted, READ_CHUNK_BYTES))
            if not chunk:
                break
            self.total += len(chunk)
            if self.total > MAX_TOTAL_BYTES:
                raise HubRefused(f"{self.filename}: inflates to more than {MAX_TOTAL_BYTES} bytes, the hub's limit "
                                 "an archive (MAX_TOTAL_BYTES)")
            parts.append(chunk)
            wanted -= len(chunk)
        return b"".join(parts)


class _LargeHeader(Exception):
    pass


class _SmallHeaders(tarfile.TarInfo):
    """A tar member whose extended header (pax, GNU long name) is refused over
    ``MAX_METADATA_BYTES`` before tarfile reads it whole into memory."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED_HEADERS and self.size > MAX_METADATA_BYTES:
            raise _LargeHeader(f"an extended header (pax or GNU long name) of {self.size} bytes, over the hub's "
                               f"limit of {MAX_METADATA_BYTES} (MAX_METADATA_BYTES)")
        # tarfile's own dispatch on the member's type (a private method: not in the typing stubs)
        processed: tarfile.TarInfo = super()._proc_member(archive)  # type: ignore[misc]
        return processed


_EXTENDED_HEADERS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                     tarfile.GNUTYPE_LONGLINK)


def _check_sdist_member(filename: str, member: tarfile.TarInfo, root: str) -> None:
    if not _inside(member.name, root):
        raise HubRefused(f"{filename}: member {member.name!r} is not under {root}/; rebuild the sdist")
    if member.issym() or member.islnk():
        target = member.linkname if member.islnk() else str(PurePosixPath(member.name).parent / member.linkname)
        if not _inside(target, root):
            raise HubRefused(f"{filename}: link {member.name!r} points out of the archive ({member.linkname!r})")
    elif not (member.isfile() or member.isdir()):
        raise HubRefused(f"{filename}: member {member.name!r} is not a file or a folder")
    limit, what = ((MAX_METADATA_BYTES, "MAX_METADATA_BYTES") if member.name == f"{root}/PKG-INFO" else
                   (MAX_MEMBER_BYTES, "MAX_MEMBER_BYTES"))
    if member.size > limit:
        raise HubRefused(f"{filename}: member {member.name!r} is {member.size} bytes, over the hub's limit of {limit} "
                         f"({what})")


# --- the pyproject.toml of an environment package ---------------------------------------------

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "{owner}-{name}"
version = "{version}"
description = "{description}"
readme = "README.md"
requires-python = ">=3.11"
# Your own dependencies, by name and version. Not the platform: Flywheel (flywheel-rl) is where the
# environment loads, and the hub index, which serves environments, does not serve it.
dependencies = {dependencies}

# `flywheel eval {owner}/{name}` and a run config's `env = "{owner}/{name}"` find it here.
[project.entry-points."flywheel.environments"]
"{owner}/{name}" = "{pkg}:load_environment"

[tool.setuptools]
packages = ["{pkg}"]

[tool.setuptools.package-data]
{pkg} = {package_data}
'''


def pyproject(owner: str, name: str, pkg: str, description: str, package_data: list[str],
              version: str = "0.1.0", dependencies: Sequence[str] = ()) -> str:
    """The pyproject.toml of an environment package: the distribution ``owner-name`` (what the
    hub serves), registering ``owner/name`` under the flywheel.environments entry points, with
    ``package_data`` (globs) shipped beside the module ``pkg`` and ``dependencies`` (requirements
    by name and version)."""
    return PYPROJECT.format(owner=owner, name=name, pkg=pkg, version=version, description=description,
                            package_data=json.dumps(package_data), dependencies=json.dumps(list(dependencies)))
