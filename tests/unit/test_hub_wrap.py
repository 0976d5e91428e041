"""Which folders ``flywheel env push`` takes as packages of another format, and what it says
when the hub id is missing or given to a Flywheel package (the wrapping itself, built and
pushed to a real hub: tests/e2e/test_verifiers_hub.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flywheel.ops.hub import bridged_format, push, wrap
from flywheel.sdk.hub import HubError


def project(folder: Path, dependencies: list[str], entry_points: str = "") -> Path:
    folder.mkdir(parents=True)
    text = f'[project]\nname = "x"\nversion = "0.1.0"\ndependencies = {dependencies!r}\n'
    (folder / "pyproject.toml").write_text(text + entry_points)
    return folder


def test_a_package_of_another_format_is_told_by_its_dependencies(tmp_path: Path) -> None:
    assert bridged_format(project(tmp_path / "vf", ["verifiers==0.4.0", "numpy"])) == "verifiers:"
    assert bridged_format(project(tmp_path / "oe", ["openenv-core>=0.2; python_version >= '3.10'"])) == "openenv:"
    assert bridged_format(project(tmp_path / "plain", ["numpy"])) is None
    flywheel = project(tmp_path / "fw", ["verifiers"], '[project.entry-points."flywheel.environments"]\n'
                                                       '"acme/x" = "x:load_environment"\n')
    assert bridged_format(flywheel) is None  # it registers a Flywheel environment: it is one
    assert bridged_format(tmp_path / "nowhere") is None


def test_push_asks_for_the_hub_id_of_a_verifiers_package_and_refuses_one_for_a_flywheel_package(
        tmp_path: Path) -> None:
    hub: Any = None  # nothing reaches the hub: each refusal comes first
    with pytest.raises(HubError, match=r"is a verifiers package: give the hub id it goes under \(flywheel env push "
                                       r"DIR --as owner/name\)"):
        push(project(tmp_path / "vf", ["verifiers"]), hub)
    flywheel = project(tmp_path / "fw", [], '[project.entry-points."flywheel.environments"]\n'
                                            '"acme/x" = "x:load_environment"\n')
    with pytest.raises(HubError, match=r"--as acme/y: .* is a Flywheel environment package, whose pyproject.toml "
                                       r"names its id"):
        push(flywheel, hub, as_id="acme/y")
    with pytest.raises(HubError, match=r"--as: environment id 'Acme Y'"):
        wrap(tmp_path / "vf", "Acme Y", tmp_path / "out")
    with pytest.raises(HubError, match=r"not a verifiers or OpenEnv package"):
        wrap(tmp_path / "fw", "acme/y", tmp_path / "out")
