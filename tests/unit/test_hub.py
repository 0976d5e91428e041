"""The environment hub's packages: what a push must hold (flywheel_gateway.hub), and how the
trace store keeps environments, immutable versions and their files (on SQLite and PostgreSQL)."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import zipfile

import pytest

from flywheel.contract.hub import HubRefused, project_name
from flywheel.contract.hubpackage import MAX_MEMBERS, MAX_METADATA_BYTES, MAX_TOTAL_BYTES, check_wheel
from flywheel_gateway.hub import inspect_package
from flywheel_gateway.store import HubConflict, Store

ENV = "acme/word-quiz"
MAX = 1 << 20


def wheel(project: str = "acme_word_quiz", version: str = "0.1.0", env_id: str = ENV,
          extra: dict[str, bytes] | None = None, entry_points: str | None = None, tag: str = "py3-none-any",
          requires: list[str] | None = None, compression: int = zipfile.ZIP_STORED,
          recorded: dict[str, bytes] | None = None) -> tuple[str, bytes]:
    """A wheel as a build backend writes one (the files pip and the hub read); ``extra``
    members are listed in its RECORD like the others, with the hash and size of what
    ``recorded`` says they hold, where it names them."""
    info = f"{project}-{version}.dist-info"
    module = project.replace("-", "_")
    dependencies = "".join(f"Requires-Dist: {r}\n" for r in requires or [])
    members = {
        f"{module}/__init__.py": b"def load_environment(**args): ...\n",
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
                             f"Summary: Answer a question with a word.\n{dependencies}\n"
                             "# word-quiz\n\nThe README.\n").encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
        f"{info}/entry_points.txt": (entry_points if entry_points is not None else
                                     f"[flywheel.environments]\n{env_id} = {module}:load_environment\n").encode(),
        **(extra or {}),
    }
    listed = {**members, **(recorded or {})}
    record = "".join(f"{name},sha256={_digest(data)},{len(data)}\n" for name, data in listed.items())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return f"{project}-{version}-{tag}.whl", buffer.getvalue()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def sdist(project: str = "acme_word_quiz", version: str = "0.1.0",
          members: list[tarfile.TarInfo] | None = None) -> tuple[str, bytes]:
    root = f"{project}-{version}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in ((f"{root}/PKG-INFO", b"Name: x\n"), (f"{root}/pyproject.toml", b"[project]\n")):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
        for member in members or []:
            archive.addfile(member, io.BytesIO(b"") if member.isfile() else None)
    return f"{root}.tar.gz", buffer.getvalue()


def push(*files: tuple[str, bytes], version: str = "0.1.0", env_id: str = ENV) -> None:
    inspect_package(env_id, version, dict(files), MAX)


def test_a_wheel_and_an_sdist_of_the_environment_are_taken_with_their_metadata() -> None:
    package = inspect_package(ENV, "0.1.0", dict([wheel(), sdist()]), MAX)
    assert project_name(ENV) == "acme-word-quiz"
    assert (package.env_id, package.version, package.summary) == (ENV, "0.1.0", "Answer a question with a word.")
    assert package.readme == "# word-quiz\n\nThe README."
    assert [f.kind for f in package.files] == ["wheel", "sdist"]
    assert package.sha256 == package.files[0].sha256 and len(package.sha256) == 64


@pytest.mark.parametrize(("files", "version", "said"), [
    ([wheel(project="word_quiz")], "0.1.0", r"distribution is 'word-quiz'; this environment's is 'acme-word-quiz'"),
    ([wheel(version="0.2.0")], "0.1.0", r"version 0\.2\.0, not the pushed 0\.1\.0"),
    ([wheel(version="1.0")], "1.0", r"version '1\.0': a hub version is MAJOR\.MINOR\.PATCH"),
    ([wheel(extra={"../evil.py": b"x"})], "0.1.0", r"member '\.\./evil\.py' leaves the archive's root"),
    ([wheel(extra={"/etc/evil": b"x"})], "0.1.0", r"member '/etc/evil' leaves the archive's root"),
    ([wheel(entry_points="")], "0.1.0", r"registers no environment .* not 'acme/word-quiz'"),
    ([wheel(env_id="acme/other")], "0.1.0", r"registers \['acme/other'\]"),
    ([("acme_word_quiz-0.1.0-py3-none-any.whl", b"not a zip")], "0.1.0", r"does not open as a wheel"),
    ([("acme_word_quiz-0.1.0.zip", b"x")], "0.1.0", r"not a wheel \(\.whl\) or an sdist"),
    ([sdist()], "0.1.0", r"holds 0 wheel\(s\) and 1 sdist\(s\)"),
    ([wheel(), ("acme_word_quiz-0.1.0-py2-none-any.whl", wheel()[1])], "0.1.0", r"holds 2 wheel\(s\)"),
    ([wheel(), sdist(members=[tarfile.TarInfo("../escape.txt")])], "0.1.0", r"'\.\./escape\.txt' is not under"),
    ([wheel(), sdist(members=[tarfile.TarInfo("other-root/x.py")])], "0.1.0", r"is not under acme_word_quiz-0\.1\.0/"),
    ([wheel(), ("acme_word_quiz-0.1.0.tar.gz", b"not gzip")], "0.1.0", r"does not open as an sdist"),
])
def test_a_push_that_does_not_hold_the_environment_is_refused_naming_the_file(
        files: list[tuple[str, bytes]], version: str, said: str) -> None:
    with pytest.raises(HubRefused, match=said):
        push(*files, version=version)


def test_links_out_of_an_sdist_and_files_over_the_limit_are_refused() -> None:
    link = tarfile.TarInfo("acme_word_quiz-0.1.0/secret")
    link.type, link.linkname = tarfile.SYMTYPE, "../../../etc/passwd"
    with pytest.raises(HubRefused, match=r"link 'acme_word_quiz-0\.1\.0/secret' points out of the archive"):
        push(wheel(), sdist(members=[link]))
    name, data = wheel(extra={"big.bin": b"\0" * MAX})
    with pytest.raises(HubRefused, match=rf"{name}: \d+ bytes, over the hub's limit of {MAX} a file"):
        push((name, data))
    with pytest.raises(HubRefused, match=r"environment id 'Acme/x': an id is owner/name"):
        push(wheel(), env_id="Acme/x")


async def test_a_version_is_stored_whole_once_and_never_changes(store: Store) -> None:
    first = inspect_package(ENV, "0.1.0", dict([wheel(), sdist()]), MAX)
    stored = await store.hub_push(first, owner="acme", private=False, pushed_by="k1")
    assert (stored["env_id"], stored["version"], stored["sha256"]) == (ENV, "0.1.0", first.sha256)
    # The same version again, even with other content, is refused and changes nothing.
    other = inspect_package(ENV, "0.1.0", dict([wheel(extra={"more.py": b"x"})]), MAX)
    with pytest.raises(HubConflict, match=r"acme/word-quiz@0\.1\.0 exists: a pushed version never changes"):
        await store.hub_push(other, owner="acme", private=False, pushed_by="k1")
    await store.hub_push(inspect_package(ENV, "0.10.0", dict([wheel(version="0.10.0")]), MAX),
                         owner="acme", private=True, pushed_by=None)  # private is the first push's to say
    env = await store.hub_environment(ENV)
    assert env is not None and (env["owner"], env["private"], env["forked_from"]) == ("acme", False, None)
    assert [v["version"] for v in env["versions"]] == ["0.10.0", "0.1.0"]  # by number, newest first
    assert [(f["kind"], f["sha256"]) for f in env["versions"][1]["files"]] == [
        ("wheel", first.sha256), ("sdist", first.files[1].sha256)]
    found = await store.hub_file(first.files[0].filename)
    assert found is not None and found["data"] == first.files[0].data and found["owner"] == "acme"
    assert await store.hub_file("acme_word_quiz-9.9.9-py3-none-any.whl") is None
    assert await store.hub_environment("acme/none") is None


async def test_another_tenant_cannot_push_to_an_environment_and_private_ones_are_listed_to_their_owner(
        store: Store) -> None:
    await store.hub_push(inspect_package(ENV, "0.1.0", dict([wheel()]), MAX), owner="acme", private=False,
                         pushed_by=None)
    intruder = inspect_package(ENV, "0.2.0", dict([wheel(version="0.2.0")]), MAX)
    with pytest.raises(HubRefused, match=r"environment 'acme/word-quiz' belongs to tenant 'acme'"):
        await store.hub_push(intruder, owner="mallory", private=False, pushed_by=None)
    env = await store.hub_environment(ENV)
    assert env is not None and [v["version"] for v in env["versions"]] == ["0.1.0"]  # nothing of the refused push
    assert await store.hub_file(intruder.files[0].filename) is None

    secret = "acme/secret-quiz"
    files = dict([wheel(project="acme_secret_quiz", env_id=secret)])
    await store.hub_push(inspect_package(secret, "0.1.0", files, MAX), owner="acme", private=True, pushed_by=None)
    assert [e["id"] for e in await store.hub_environments("acme")] == [secret, ENV]
    assert [e["id"] for e in await store.hub_environments("mallory")] == [ENV]
    listed = await store.hub_environments(None)  # the deployment's services see every one
    assert [(e["id"], e["latest_version"], e["summary"]) for e in listed] == [
        (secret, "0.1.0", "Answer a question with a word."), (ENV, "0.1.0", "Answer a question with a word.")]
    assert await store.hub_set_private(secret, False) and not await store.hub_set_private("acme/none", True)
    assert [e["id"] for e in await store.hub_environments("mallory")] == [secret, ENV]


def test_archives_over_the_size_and_member_caps_are_refused_while_inflating() -> None:
    # An sdist (kept for reading) whose files are each under the per-file cap but together
    # inflate past the archive's: refused by the count of what is inflated, a chunk at a time.
    root = "acme_word_quiz-0.1.0"
    buffer = io.BytesIO()
    part = b"\0" * (30 << 20)
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for name, data in [(f"{root}/PKG-INFO", b"Name: x\n")] + [(f"{root}/part{i}", part) for i in range(5)]:
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    with pytest.raises(HubRefused, match=rf"\.tar\.gz: inflates to more than {MAX_TOTAL_BYTES} bytes.*MAX_TOTAL_BYTES"):
        push(wheel(), (f"{root}.tar.gz", buffer.getvalue()))
    big_info = tarfile.TarInfo(f"{root}/PKG-INFO")
    big_info.size = MAX_METADATA_BYTES + 1
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.addfile(big_info, io.BytesIO(b"x" * big_info.size))
    with pytest.raises(HubRefused, match=rf"member '{root}/PKG-INFO' is {MAX_METADATA_BYTES + 1} bytes.*"
                                         "MAX_METADATA_BYTES"):
        push(wheel(), (f"{root}.tar.gz", buffer.getvalue()))
    many = {f"acme_word_quiz/m{i}.py": b"" for i in range(MAX_MEMBERS)}
    with pytest.raises(HubRefused, match=rf"more than {MAX_MEMBERS} members \(MAX_MEMBERS\)"):
        push(wheel(extra=many))


def test_a_checked_wheel_says_what_it_installs() -> None:
    made = wheel(extra={"acme_word_quiz/tasks.jsonl": b'{"q": 1}\n'}, requires=["numpy>=1"])
    checked = check_wheel(*made, ENV, "0.1.0")
    assert (checked.modules, checked.requires) == (["acme_word_quiz"], ["numpy>=1"])
    assert "acme_word_quiz/tasks.jsonl" in checked.files and "acme_word_quiz-0.1.0.dist-info/RECORD" in checked.files


def test_an_sdist_with_a_huge_extended_header_is_refused_before_it_is_read() -> None:
    root = "acme_word_quiz-0.1.0"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as archive:
        member = tarfile.TarInfo(f"{root}/PKG-INFO")
        member.pax_headers = {"comment": "x" * (MAX_METADATA_BYTES + 1)}
        archive.addfile(member, io.BytesIO(b""))
    with pytest.raises(HubRefused, match=r"\.tar\.gz: an extended header \(pax or GNU long name\) of \d+ bytes"):
        push(wheel(), (f"{root}.tar.gz", buffer.getvalue()))
