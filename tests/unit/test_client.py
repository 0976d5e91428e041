"""Task building without a server: ids, validation of names, JSONL reading.

Publishing against a real nats-server is in tests/integration/test_client.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flywheel.contract.events import task_id
from flywheel.contract.names import check_key, check_token
from flywheel.ops import cli
from flywheel.ops.client import read_jsonl
from flywheel.runtime.natsserver import free_port
from flywheel.runtime.tasks import make_tasks


def test_derived_task_ids_are_deterministic_and_pinned() -> None:
    row = {"text": "abc", "meta": {"b": 1, "a": [1, 2]}}
    same_row_other_key_order = {"meta": {"a": [1, 2], "b": 1}, "text": "abc"}
    first = task_id("r1", "echo", 1, row)
    assert first == task_id("r1", "echo", 1, same_row_other_key_order)
    assert len({first, task_id("r2", "echo", 1, row), task_id("r1", "other", 1, row),
                task_id("r1", "echo", 2, row), task_id("r1", "echo", 1, {"text": "abd"})}) == 5
    # Pinned: a change here changes the id of every task already published from a file.
    assert task_id("r1", "echo", 1, {"text": "abc"}) == "f69f940e9c4a5cdf94fa9d8f28e31843"


def test_a_rows_own_string_id_is_its_task_id() -> None:
    assert task_id("r1", "echo", 7, {"id": "q-17", "text": "x"}) == "q-17"
    derived = task_id("r1", "echo", 7, {"id": 17})  # not a string: the id is derived
    assert derived != "17" and len(derived) == 32
    for bad in ("", "  ", "a\nb"):
        with pytest.raises(ValueError, match="task id must be non-empty and on one line"):
            task_id("r1", "echo", 1, {"id": bad})


def test_make_tasks() -> None:
    tasks = make_tasks("r1", "echo", [(1, {"text": "a"}), (3, {"id": "own", "text": "b"})], num_rollouts=4)
    assert [t.subject() for t in tasks] == ["tasks.r1.echo", "tasks.r1.echo"]
    assert tasks[0].id == task_id("r1", "echo", 1, {"text": "a"}) and tasks[1].id == "own"
    assert all(t.num_rollouts == 4 for t in tasks)
    assert tasks[1].data == {"id": "own", "text": "b"}  # the row travels unchanged


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a*", "a>", "tab\there", "x" * 129])
@pytest.mark.parametrize("field", ["run", "env"])
def test_run_and_env_must_be_subject_tokens(field: str, bad: str) -> None:
    names = {"run": "r1", "env": "echo"} | {field: bad}
    with pytest.raises(ValueError) as err:
        make_tasks(names["run"], names["env"], [(1, {"x": 1})])
    assert str(err.value).startswith(f"{field}={bad!r}")


def test_run_must_also_be_a_kv_key_and_env_need_not() -> None:
    with pytest.raises(ValueError, match=r"^run='r:1': a run id is 1 to 128 letters, digits"):
        make_tasks("r:1", "echo", [(1, {})])
    assert check_token("env", "math:gsm8k") == "math:gsm8k"
    assert check_key("tenant", "acme/eu-1") == "acme/eu-1"
    with pytest.raises(ValueError, match=r"^tenant="):
        check_key("tenant", "acme corp")


def test_num_rollouts_and_rows_are_checked() -> None:
    with pytest.raises(ValueError, match="num_rollouts must be at least 1, got 0"):
        make_tasks("r1", "echo", [(1, {})], num_rollouts=0)
    with pytest.raises(ValueError, match=r"^row 2: a task row must be a JSON object \(dict\), got list"):
        make_tasks("r1", "echo", [(1, {}), (2, [1])])  # type: ignore[list-item]  # a list row: the error under test
    with pytest.raises(ValueError, match=r"^rows.jsonl:5: id 'q1' repeats rows.jsonl:2; task ids must be unique"):
        make_tasks("r1", "echo", [(2, {"id": "q1"}), (3, {"x": 1}), (5, {"id": "q1", "x": 2})], source="rows.jsonl")
    with pytest.raises(ValueError, match=r"^rows.jsonl:4: not JSON-serializable"):
        make_tasks("r1", "echo", [(4, {"when": object()})], source="rows.jsonl")


def test_read_jsonl_numbers_rows_by_file_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n\n  \n{"id": "t2", "text": "b"}\n')
    assert list(read_jsonl(path)) == [(1, {"text": "a"}), (4, {"id": "t2", "text": "b"})]


@pytest.mark.parametrize("content, message", [
    ('{"a": 1}\n{"a": 2\n', r"rows.jsonl:2: not valid JSON"),
    ('{"a": 1}\n\n[1, 2]\n', r"rows.jsonl:3: a task row must be a JSON object, got list"),
    ('"text"\n', r"rows.jsonl:1: a task row must be a JSON object, got str"),
    ("\n\n", r"rows.jsonl: no task rows"),
])
def test_bad_jsonl_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        list(read_jsonl(path))


def test_cli_checks_the_whole_file_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\nnot json\n')
    nowhere = f"nats://127.0.0.1:{free_port()}"  # connecting would take the 30 s connect timeout
    began = time.monotonic()
    assert cli.main(["tasks", "publish", "echo", "--run", "r1", "--file", str(path), "--nats-url", nowhere]) == 1
    assert time.monotonic() - began < 5
    assert f"flywheel: error: {path}:3: not valid JSON" in capsys.readouterr().err
    assert cli.main(["tasks", "publish", "e.x", "--run", "r1", "--file", str(path), "--nats-url", nowhere]) == 1
    assert "flywheel: error: env='e.x' is not a valid NATS subject token" in capsys.readouterr().err
