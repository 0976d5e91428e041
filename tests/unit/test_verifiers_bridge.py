"""The verifiers bridge's parts that need no verifiers: ids, configs, a program's dependencies
(tests/e2e/test_verifiers_envs.py runs real tasksets)."""

from __future__ import annotations

import pytest

from flywheel.sdk import verifiers_bridge
from flywheel.sdk.environment import EnvironmentLoadError, load_environment, subject_name


def test_the_default_harness_is_verifiers_plain_chat_and_the_runtime_is_always_the_subprocess_one() -> None:
    config = verifiers_bridge.env_config("vf-echo", {"num_tasks": 3}, agent={"max_turns": 4,
                                                                            "runtime": {"type": "docker"}})
    assert config == {"taskset": {"num_tasks": 3, "id": "vf-echo"},
                      "agent": {"max_turns": 4, "runtime": {"type": "subprocess"}, "harness": {"id": "null"}}}
    # {} takes the taskset's own harness (verifiers' default for it)
    assert "harness" not in verifiers_bridge.env_config("vf-echo", harness={})["agent"]


def test_a_verifiers_id_is_named_in_subjects_by_its_environment_name() -> None:
    assert subject_name("verifiers:vf-echo", "vf_echo") == "vf_echo"


def test_a_verifiers_id_without_a_taskset_or_without_verifiers_says_what_to_do() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"name the package after 'verifiers:'"):
        load_environment("verifiers:")
    # The services' environment has no verifiers (it lives in a taskset's own folder).
    with pytest.raises(EnvironmentLoadError, match="flywheel env install verifiers:"):
        load_environment("verifiers:vf-echo")


def test_a_program_s_declared_dependencies_are_checked_against_this_python() -> None:
    script = (b'# /// script\n# requires-python = ">=3.10"\n'
              b'# dependencies = ["packaging", "packaging<1", "no-such-package-here==1.0"]\n# ///\nprint(1)\n')
    assert verifiers_bridge._missing_dependencies(script) == ["packaging<1", "no-such-package-here==1.0"]
    assert verifiers_bridge._missing_dependencies(b"print(1)\n") == []
