"""The event contract: light imports, round trips, and decoding what version 1 wrote."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from flywheel.contract import events

V1 = json.loads((Path(__file__).parent / "data" / "events_v1.json").read_text())


def test_contract_module_imports_nothing_heavy() -> None:
    code = ("import sys, flywheel.contract.events; "
            "print(sorted(m for m in ('torch', 'fastapi', 'sqlalchemy', 'nats', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("i", range(len(V1["json"])))
def test_version_1_encodings_decode_with_current_code(i: int) -> None:
    decoder = events.Decoder()
    stored_json = json.dumps(V1["json"][i]).encode()
    stored_msgpack = base64.b64decode(V1["msgpack_b64"][i])
    a = decoder.decode(stored_json, events.JSON)
    b = decoder.decode(stored_msgpack, events.MSGPACK)
    assert a == b
    assert type(a).__struct_config__.tag == V1["json"][i]["type"]
    # Re-encoding keeps every field version 1 had, with the same value.
    again = json.loads(events.encode(a))
    for key, value in V1["json"][i].items():
        assert again[key] == value, key


def test_version_1_value_types_decode() -> None:
    state = events.Decoder(events.RunState).decode(json.dumps(V1["run_state"]).encode())
    assert state.tenant == "acme"
    beat = events.Decoder(events.ServiceHeartbeat).decode(json.dumps(V1["heartbeat"]).encode())
    assert beat.service == "recorder"


def test_unknown_fields_are_ignored_and_new_fields_have_defaults() -> None:
    newer = dict(V1["json"][0], field_from_the_future={"x": 1})
    task = events.Decoder().decode(json.dumps(newer).encode())
    assert isinstance(task, events.Task) and task.id == "task-1"
    minimal = {"type": "task", "run": "r", "env": "e", "data": {}}
    task = events.Decoder().decode(json.dumps(minimal).encode())
    assert task.num_rollouts == 1 and len(task.id) == 32 and task.created_at.tzinfo is not None


def test_every_field_added_after_version_1_has_a_default() -> None:
    for tag, cls in events.EVENT_TYPES.items():
        stored = [set(e) for e in V1["json"] if e["type"] == tag]
        if not stored:  # a kind of event added later (Signal): its required fields are those of its first version
            continue
        v1_fields = stored[0]
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        for f in info.fields:
            if f.encode_name not in v1_fields:
                assert not f.required, f"{cls.__name__}.{f.name} was added without a default"


def test_decode_errors_name_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$.num_rollouts"):
        events.Decoder().decode(b'{"type":"task","run":"r","env":"e","data":{},"num_rollouts":"four"}')
    with pytest.raises(msgspec.DecodeError, match="Content-Type"):
        events.Decoder().decode(b"{}", "text/plain")


def test_subjects_and_message_ids() -> None:
    d = events.Decoder()
    task, rollout, node, score, weights, dead = (d.decode(json.dumps(e).encode()) for e in V1["json"])
    assert task.subject() == "tasks.run-1.reverse-text"
    assert rollout.subject() == "rollouts.run-1.reverse-text.3"  # its group's partition: 3 of 8 for "g-1"
    assert {events.partition_of(f"g{i}") for i in range(64)} == set(range(events.ROLLOUT_PARTITIONS))
    assert node.subject() == "traces.run-1.ro-1" and node.msg_id == f"ro-1.{node.node.id}"
    assert score.subject() == "scores.run-1.reverse-text.exact"
    assert weights.subject() == "weights.run-1"
    assert dead.subject() == "dead.TASKS" and dead.payload == b"\x00\x01"


def test_node_ids_are_content_hashes_over_the_parent_chain() -> None:
    m = events.Message(role="user", content="hi")
    assert events.node_id(None, m) == events.node_id(None, events.Message(role="user", content="hi"))
    assert events.node_id(None, m) != events.node_id("p", m)
    span = events.TokenSpan(token_ids=[1])
    assert events.node_id(None, m) != events.node_id(None, m, span)
    # The tokens' texts follow from their ids: a producer with or without them makes one node.
    assert events.node_id(None, m, msgspec.structs.replace(span, texts=["a"])) == events.node_id(None, m, span)


def test_task_and_rollout_ids_are_made_one_way_and_pinned() -> None:
    # Pinned: a change here changes the id of every task already published (the client, the
    # gateway and `flywheel run` all make them here), and so every rollout id after it.
    assert events.task_id("r1", "echo", 1, {"text": "abc"}) == "f69f940e9c4a5cdf94fa9d8f28e31843"
    assert events.task_id("r1", "echo", 7, {"id": "q-17", "text": "x"}) == "q-17"  # a row's own string id
    assert events.rollout_id("r1", "q-17", 0) == "df60163944de639063b84c6769c552eb"  # eval's, as ever
    # A task id a user chose can repeat across runs; its rollouts do not.
    assert len({events.rollout_id(run, "q-17", i) for run in ("r1", "r2") for i in (0, 1)}) == 4


def test_a_rollout_from_before_its_sampling_was_recorded_decodes_without_it() -> None:
    rollout = events.Decoder(events.Rollout).decode(json.dumps(V1["json"][1]).encode())
    assert rollout.sampling is None  # its readers fall back on the run's sampling
    sampled = msgspec.structs.replace(rollout, sampling=events.Sampling(temperature=0.5, seed=3))
    assert events.Decoder(events.Rollout).decode(events.encode(sampled, events.MSGPACK), events.MSGPACK) == sampled


def test_json_schema_covers_every_event_and_matches_the_docs() -> None:
    schema = events.json_schema()
    assert {"Task", "Rollout", "TraceNode", "Score", "WeightUpdate", "DeadLetter"} <= set(schema["$defs"])
    published = Path(__file__).parents[2] / "docs" / "events.schema.json"
    assert json.loads(published.read_text()) == schema, \
        "docs/events.schema.json is stale: run `flywheel schema --out docs/events.schema.json`"
