"""The OpenEnv bridge's parsing and rendering, with a pydantic model in place of an OpenEnv action
(tests/e2e/test_openenv_envs.py runs a real OpenEnv environment)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from flywheel.sdk import openenv_bridge
from flywheel.sdk.environment import EnvironmentLoadError, load_environment


class Move(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as every OpenEnv action
    metadata: dict[str, Any] = Field(default_factory=dict)
    row: int = Field(..., ge=0, le=2, description="the row")
    col: int = Field(..., ge=0, le=2)


@pytest.mark.parametrize("reply", ['{"row": 1, "col": 2}', 'Centre right: {"row": 1, "col": 2}.',
                                   'First {"row": 0, "col": 0}, no: {"row": 1, "col": 2}',
                                   'Here:\n```json\n{"row": 1, "col": 2}\n```'])
def test_the_last_json_object_of_a_reply_is_its_action(reply: str) -> None:
    assert openenv_bridge.parse_action(reply, Move) == Move(row=1, col=2)


@pytest.mark.parametrize(("reply", "says"), [
    ("the middle one", "no JSON object in the reply"),
    ('{"row": 5, "col": 0}', "row: Input should be less than or equal to 2"),
    ('{"row": 1}', "col: Field required"),
    ('{"row": 1, "col": 1, "colour": "x"}', "colour: Extra inputs are not permitted"),
    ('{"row": 1, "col": 1, "metadata": {"admin": true}}', "'metadata' is not the agent's to set"),
])
def test_a_reply_that_is_no_action_says_which_field_is_wrong(reply: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        openenv_bridge.parse_action(reply, Move)


def test_the_action_schema_leaves_metadata_out() -> None:
    schema = openenv_bridge.action_schema(Move)
    assert sorted(schema["properties"]) == ["col", "row"] and schema["required"] == ["row", "col"]


def test_an_observation_renders_as_its_fields_or_its_one_text() -> None:
    assert openenv_bridge.render({"board": "x..", "done": False, "reward": 0.0, "metadata": {}}) == "x.."
    assert openenv_bridge.render({"board": "x..", "turn": 3, "done": True, "reward": None, "metadata": {"k": 1}}) == \
        '{"board": "x..", "turn": 3}'


def test_an_openenv_id_without_a_package_or_without_openenv_says_what_to_do() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"name the package after 'openenv:'"):
        load_environment("openenv:")
    with pytest.raises(EnvironmentLoadError, match="flywheel env install openenv:"):
        load_environment("openenv:guess-number")
