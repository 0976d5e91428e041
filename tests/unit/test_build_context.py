"""Build contexts (``context_archive``) are the same bytes for the same files, and their tags
(``build_tag``) follow the content; what the local backend and a build request refuse."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import msgspec
import pytest

from flywheel.contract.settings import SandboxSettings
from flywheel.sdk.sandbox import BuildRequest, SandboxError, build_tag, context_archive


def make(folder: Path) -> Path:
    (folder / "sub").mkdir(parents=True)
    (folder / "Dockerfile").write_text("FROM x\nRUN true\n")
    (folder / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (folder / "sub" / "run.sh").chmod(0o755)
    return folder


def test_the_same_files_make_the_same_archive_and_tag(tmp_path: Path) -> None:
    one, two = make(tmp_path / "one"), make(tmp_path / "two")
    os.utime(two / "Dockerfile", (0, 0))  # times and places do not count
    assert context_archive(one) == context_archive(two)
    assert build_tag(context_archive(one)) == build_tag(context_archive(two))
    with tarfile.open(fileobj=io.BytesIO(context_archive(one))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["Dockerfile", "sub", "sub/run.sh"] and members["sub/run.sh"].mode == 0o755
    assert (members["Dockerfile"].uid, members["Dockerfile"].mtime) == (0, 0)
    (two / "Dockerfile").write_text("FROM x\nRUN false\n")
    assert build_tag(context_archive(one)) != build_tag(context_archive(two))
    assert build_tag(context_archive(one)) != build_tag(context_archive(one), "sub/run.sh")


def test_a_link_is_refused_naming_it(tmp_path: Path) -> None:
    folder = make(tmp_path / "ctx")
    (folder / "out").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match=r"ctx/out: a build context holds plain files and folders only"):
        context_archive(folder)


def test_a_dockerfile_path_that_climbs_or_a_long_timeout_is_refused() -> None:
    decode = msgspec.json.Decoder(BuildRequest).decode
    with pytest.raises(msgspec.ValidationError, match=r"\$.dockerfile"):
        decode(b'{"context": "eA==", "dockerfile": "/etc/Dockerfile"}')
    for climbing in ("../Dockerfile", "a/../../Dockerfile", ".."):
        with pytest.raises(msgspec.ValidationError, match=r"\$.dockerfile"):
            decode(b'{"context": "eA==", "dockerfile": "%s"}' % climbing.encode())
    assert decode(b'{"context": "eA==", "dockerfile": "docker/..file"}').dockerfile == "docker/..file"
    with pytest.raises(msgspec.ValidationError, match=r"\$.timeout_s"):
        decode(b'{"context": "eA==", "timeout_s": 7200}')
    with pytest.raises(msgspec.ValidationError, match=r"\$.context"):
        decode(b'{"context": ""}')


async def test_the_local_backend_refuses_a_build_naming_the_docker_backend() -> None:
    from flywheel_sandbox.backends import LocalBackend

    backend = LocalBackend()
    try:
        with pytest.raises(SandboxError, match=r"runs no images.*sandbox_backend = \"docker\"") as refused:
            await backend.build(BuildRequest(context=b"x"), SandboxSettings())
        assert refused.value.kind == "unsupported"
    finally:
        await backend.close()
