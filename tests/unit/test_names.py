"""One answer to what a run id is: the run config, the task builder, the gateway and the run's folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from flywheel.contract import weights
from flywheel.contract.bus import Bus
from flywheel.contract.checkpoints import run_folder
from flywheel.contract.config import RunConfig
from flywheel.contract.names import is_run_id, path_name
from flywheel.runtime.tasks import make_tasks
from flywheel_gateway.models import run_id as gateway_run_id

SAMPLES = ["r1", "team/a", "a=b", "A-b_c", "x" * 128, "x" * 129, "", "a b", "a.b", "a:b", "a%2Fb", "é", "*", ">"]


def accepts(check: Callable[[str], object], value: str) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("value", SAMPLES)
def test_every_place_that_takes_a_run_id_gives_the_same_answer(value: str) -> None:
    answers = {
        "rule": is_run_id(value),
        "run config": accepts(lambda v: RunConfig.parse({"run": v, "env": "reverse_text"}), value),
        "tasks": accepts(lambda v: make_tasks(v, "echo", [(1, {})]), value),
        "gateway": accepts(gateway_run_id, value),
    }
    assert len(set(answers.values())) == 1, answers


def test_a_run_id_with_a_slash_has_a_folder_of_its_own(tmp_path: Path) -> None:
    assert run_folder(tmp_path, "team/a") == tmp_path / "runs" / "team%2Fa"
    assert run_folder(tmp_path, "team/a") != run_folder(tmp_path, "team") / "a"
    assert path_name("r1") == "r1"
    with pytest.raises(ValueError, match="a run id is"):
        path_name("../escape")


async def test_a_run_id_with_a_slash_keeps_its_weights_in_a_folder_of_its_own(tmp_path: Path) -> None:
    no_bus = cast(Bus, None)  # weights in a folder never reach the bus
    uri, _, size = await weights.put(no_bus, "team/a", 3, b"weights", tmp_path)
    assert (tmp_path / "team%2Fa").is_dir() and "team%252Fa" in uri and size == 7  # the folder's '%', quoted
    assert await weights.READERS["file"](no_bus, uri) == b"weights"
    assert await weights.versions(no_bus, "team/a", tmp_path) == [3]
