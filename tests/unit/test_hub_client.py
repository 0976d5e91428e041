"""The hub's client side (flywheel.ops.hub): what a package folder must say, how a fork renames
one, and the check a push runs on the wheel it built (in a process of its own)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flywheel.ops.hub import check_built, check_files, read_project, rename
from flywheel.ops.scaffold import scaffold
from flywheel.sdk.hub import HubError


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return scaffold("qa", tmp_path / "src", owner="acme")


def test_a_scaffolded_folder_is_an_environment_of_its_owner(folder: Path) -> None:
    project = read_project(folder)
    assert (project.env_id, project.version, project.module, project.project) == ("acme/qa", "0.1.0", "qa",
                                                                                  "acme-qa")


@pytest.mark.parametrize(("old", "new", "said"), [
    ('name = "acme-qa"', 'name = "qa"', r"\[project\] name is 'qa'; the package of acme/qa must be named 'acme-qa'"),
    ('version = "0.1.0"', 'version = "1.0"', r"version '1\.0': a hub version is MAJOR\.MINOR\.PATCH"),
    ('"acme/qa" = "qa:load_environment"', '"acme/qa" = "qa:load_environment"\n"acme/b" = "qa:load_environment"',
     r"registers \['acme/b', 'acme/qa'\]; a package pushed to the hub registers exactly one"),
    ('"acme/qa" = ', '"Acme/QA" = ', r"environment id 'Acme/QA': an id is owner/name"),
])
def test_a_folder_that_does_not_name_its_environment_right_is_refused(folder: Path, old: str, new: str,
                                                                      said: str) -> None:
    pyproject = folder / "pyproject.toml"
    assert old in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(old, new))
    with pytest.raises(HubError, match=said):
        read_project(folder)


def test_no_pyproject_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HubError, match=r"pyproject.toml: not found; give the folder of an environment package"):
        read_project(tmp_path)


def test_a_fork_renames_distribution_entry_point_and_module(folder: Path) -> None:
    rename(folder, "acme/qa", "bob/qa")
    project = read_project(folder)
    assert (project.env_id, project.project, project.module) == ("bob/qa", "bob-qa", "bob_qa")
    assert (folder / "bob_qa" / "__init__.py").exists() and not (folder / "qa").exists()
    assert (folder / "tests" / "test_bob_qa.py").exists()
    pyproject = (folder / "pyproject.toml").read_text()
    assert 'packages = ["bob_qa"]' in pyproject and 'bob_qa = ["tasks.jsonl"]' in pyproject
    assert "acme/qa" not in (folder / "README.md").read_text()


def wheel_of(folder: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(folder)], check=True, timeout=180)
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.long
def test_the_check_runs_a_built_package_and_refuses_one_whose_reward_fails(folder: Path, tmp_path: Path) -> None:
    report = check_built(wheel_of(folder, tmp_path / "good"), "acme/qa")
    assert report["errors"] == [] and report["rows"] == 3, report
    assert report["rewards"]["correct"] == [1.0, 1.0, 1.0] and set(report["rewards"]) == {"correct", "length"}
    module = folder / "qa" / "__init__.py"
    module.write_text(module.read_text().replace("def correct(completion: str, task: dict) -> float:\n",
                                                 "def correct(completion: str, task: dict) -> float:\n"
                                                 "    raise KeyError('answer_text')\n"))
    broken = wheel_of(folder, tmp_path / "broken")
    with pytest.raises(HubError, match=r"(?s)does not pass its check.*task row 0: reward 'correct' failed: KeyError"):
        check_built(broken, "acme/qa")
    assert check_built(broken, "acme/qa", scoring=False)["errors"] == []
    (folder / "qa" / "tasks.jsonl").write_text("")  # a package without its task rows does not load
    with pytest.raises(HubError, match=r"does not pass its check"):
        check_built(wheel_of(folder, tmp_path / "empty"), "acme/qa")


def test_a_package_that_does_not_import_is_refused(folder: Path, tmp_path: Path) -> None:
    module = folder / "qa" / "__init__.py"
    module.write_text(module.read_text() + "\nimport a_module_nobody_installed\n")
    with pytest.raises(HubError, match=r"(?s)load_environment\('acme/qa'\) with its defaults failed: "
                                       r"ModuleNotFoundError: No module named 'a_module_nobody_installed'"):
        check_built(wheel_of(folder, tmp_path / "wheel"), "acme/qa")


def test_harbor_task_folders_import_as_a_package_to_push(tmp_path: Path) -> None:
    from flywheel.ops.cli import main

    tasks = Path(__file__).resolve().parents[2] / "environments" / "harbor_tasks" / "tests" / "tasks"
    assert main(["env", "import", "harbor", str(tasks), "acme/terminal", "--dir", str(tmp_path)]) == 0
    project = read_project(tmp_path / "terminal")
    assert (project.env_id, project.project, project.version) == ("acme/terminal", "acme-terminal", "0.1.0")
    assert main(["env", "import", "harbor", str(tasks), "Acme/x", "--dir", str(tmp_path)]) == 1


def test_a_format_with_no_importer_is_refused_naming_the_formats_there_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.ops.cli import main

    assert main(["env", "import", "openenv", str(tmp_path), "acme/x", "--dir", str(tmp_path)]) == 1
    assert "format 'openenv': no importer for it is installed; the formats: harbor" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_scaffolded_package_asks_for_nothing_the_hub_index_does_not_serve(folder: Path) -> None:
    # The hub serves environments, not the platform: `pip install --index-url <gateway>/hub/simple`
    # resolves every dependency there.
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []


def test_push_checks_what_it_built_by_the_hubs_rules_before_anything_runs(folder: Path, tmp_path: Path) -> None:
    project = read_project(folder)
    check_files(project, [wheel_of(folder, tmp_path / "good")])  # a scaffolded package is what the hub takes
    pyproject = folder / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("[tool.setuptools]\n",
                                                       '[project.scripts]\nqa = "qa:load_environment"\n\n'
                                                       "[tool.setuptools]\n"))
    with pytest.raises(HubError, match=r"the hub would refuse what .* builds: acme_qa-0\.1\.0-py3-none-any\.whl: "
                                       r"declares entry points of the group 'console_scripts' \(qa\)"):
        check_files(project, [wheel_of(folder, tmp_path / "scripts")])
