"""The SFT job's data: chats become the sequences inference would give the model, a trace API
export is learned token for token, and every line that cannot be learned is refused with its
place; batches go epoch by epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_trainer.chats import DataError, batches, line_examples, load_examples


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> object:
    return models.load_model(tiny_model_dir)[1]


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_each_assistant_message_is_learned_in_the_context_inference_gives(tok: object) -> None:
    chat = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abc"},
            {"role": "assistant", "content": "cba"}, {"role": "user", "content": "de"},
            {"role": "assistant", "content": "ed"}]
    first, second = line_examples(tok, {"messages": chat}, "data.jsonl:1")
    messages = [events.Message(role=m["role"], content=m["content"]) for m in chat]  # type: ignore[arg-type]
    for example, upto, answer in ((first, 2, "cba"), (second, 4, "ed")):
        prompt = models.render_prompt(tok, messages[:upto])
        assert example.token_ids[:len(prompt)] == prompt and not any(example.loss_mask[:len(prompt)])
        learned = [t for t, m in zip(example.token_ids, example.loss_mask, strict=True) if m]
        assert learned == tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]  # type: ignore[attr-defined]
        assert len(example.token_ids) == len(prompt) + len(learned)  # nothing after the end of turn


def test_an_export_line_with_tokens_is_learned_exactly_and_one_without_as_a_chat(tok: object) -> None:
    exported = {"id": "r1", "reward": 1.0, "messages": [{"role": "user", "content": "ab"},
                                                        {"role": "assistant", "content": "ba"}],
                "tokens": {"token_ids": [5, 6, 7, 8], "logprobs": [0.0, 0.0, -0.5, -0.2],
                           "loss_mask": [False, False, True, True]}}
    (example,) = line_examples(tok, exported, "x:1")
    assert example.token_ids == [5, 6, 7, 8] and example.loss_mask == [False, False, True, True]
    del exported["tokens"]
    (chat,) = line_examples(tok, exported, "x:1")
    assert sum(chat.loss_mask) == len(tok.encode("ba", add_special_tokens=False)) + 1  # type: ignore[attr-defined]
    # An export's tool calls are flat ({id, name, arguments}); the OpenAI shape nests them.
    calls = {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "f",
                                                                               "arguments": "{}"}]}]}
    assert len(line_examples(tok, calls, "x:2")) == 1


def test_an_exports_end_line_is_skipped_and_an_error_ended_export_refused(tok: object, tmp_path: Path) -> None:
    exported = {"id": "r1", "reward": 1.0, "error": None,
                "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    end = {"end": {"num_rollouts": 1}}
    assert line_examples(tok, end, "x:2") == []  # the closing line of a complete export: nothing to learn
    assert len(load_examples(write(tmp_path, exported, end), tok)) == 1
    assert len(load_examples(write(tmp_path, exported, end, exported, end), tok)) == 2  # two exports, one file
    with pytest.raises(DataError, match=r"data.jsonl:2: the export was cut: export cut after 1 rollouts; .*export "
                                        r"again"):
        load_examples(write(tmp_path, exported, {"error": "export cut after 1 rollouts; the rest is missing"}), tok)
    with pytest.raises(DataError, match=r"data.jsonl': an export of no rollouts"):
        load_examples(write(tmp_path, {"end": {"num_rollouts": 0}}), tok)
    # A dataset's rows carry every column, null where a line had none.
    rows = {"id": None, "reward": None, "error": None, "messages": None, "tokens": None}
    assert line_examples(tok, {**rows, **end}, "d[train][1]") == []
    with pytest.raises(DataError, match=r"d\[train\]\[1\]: the export was cut: database down"):
        line_examples(tok, {**rows, "end": None, "error": "database down"}, "d[train][1]")


def test_lines_that_cannot_be_learned_are_refused_with_their_place(tok: object, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.jsonl:2: not JSON"):
        load_examples(write(tmp_path, {"messages": [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "a"}]}, "{oops"), tok)
    cases = [
        ({"error": "export cut after 3 rollouts"}, r":1: the export was cut: export cut after 3 rollouts"),
        ({"text": "abc"}, r":1: no 'messages'"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, r":1: the chat starts with an assistant message"),
        ({"messages": [{"role": "robot", "content": "a"}]}, r":1\.messages\[0\]\.role='robot'"),
        ({"messages": [{"role": "user", "content": "a"}], "tokens": {"token_ids": [1, 2], "loss_mask": [True]}},
         r":1\.tokens: token_ids and loss_mask differ"),
        ({"messages": [{"role": "user", "content": "a" * 400}, {"role": "assistant", "content": "b"}]},
         r":1: \d+ tokens, more than the model's 256 positions"),
    ]
    for row, message in cases:
        with pytest.raises(DataError, match=message):
            load_examples(write(tmp_path, row), tok, max_positions=256)
    with pytest.raises(DataError, match=r"no assistant message to learn from"):
        load_examples(write(tmp_path, {"messages": [{"role": "user", "content": "a"}]}), tok)
    with pytest.raises(DataError, match=r"sft.data='.*missing.jsonl': no such file"):
        load_examples(tmp_path / "missing.jsonl", tok)


def test_batches_shuffle_each_epoch_and_cover_every_example_once_an_epoch() -> None:
    drawn = batches(10, 4, seed=3)
    steps = [next(drawn) for _ in range(6)]
    assert [epoch for epoch, _ in steps] == [0, 0, 1, 1, 2, 2]  # two whole batches an epoch; the rest waits
    for epoch in range(3):
        seen = [i for e, indices in steps if e == epoch for i in indices]
        assert len(seen) == len(set(seen)) == 8
    assert [next(batches(10, 4, seed=3)) for _ in range(1)] == steps[:1]  # seeded
    small = batches(3, 8, seed=0)
    assert sorted(next(small)[1]) == [0, 1, 2]  # less than a batch: all of it each step


def test_without_data_the_job_learns_the_environments_reference_answers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from flywheel.contract.config import RunConfig
    from flywheel_trainer.sft import run

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model_dir)
    cfg = RunConfig.parse({"run": "ref", "env": "reverse_text", "sft": {"steps": 3, "batch_size": 4}})
    summary = run(cfg, tmp_path, 4)
    assert summary["data"] == "reference answers" and summary["examples"] == 12 and summary["steps"] == 3
    assert (tmp_path / "runs" / "ref" / "checkpoint").exists()


def chat(text: str) -> dict:
    return {"messages": [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": text},
                         {"role": "assistant", "content": text[::-1]}]}


def test_a_datasets_dataset_is_learned_row_by_row_as_lines_of_a_file(tok: object, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder Dataset.save_to_disk wrote (a dict of splits, or one dataset) and a folder of JSON
    Lines files give the sequences the same rows give in a file; a missing split, a row that
    cannot be learned and a dataset that cannot be loaded are refused, naming what to fix."""
    import datasets

    from flywheel_trainer.chats import load_dataset_examples

    rows = [chat(t) for t in ("abc", "dcba", "ef")]
    from_file = load_examples(write(tmp_path, *rows), tok)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "saved"))
    assert load_dataset_examples(str(tmp_path / "saved"), "train", tok) == from_file
    assert load_dataset_examples(str(tmp_path / "saved"), "test", tok) == from_file[:1]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert load_dataset_examples(str(tmp_path / "one"), "train", tok) == from_file
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_dataset_examples(str(tmp_path / "files"), "train", tok) == from_file
    with pytest.raises(DataError, match=r"sft.dataset='.*saved': no split 'validation'; it has train, test"):
        load_dataset_examples(str(tmp_path / "saved"), "validation", tok)
    datasets.Dataset.from_list([*rows, {"messages": [{"role": "assistant", "content": "x"}]}]).save_to_disk(
        str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad\[train\]\[3\]: the chat starts with an assistant message"):
        load_dataset_examples(str(tmp_path / "bad"), "train", tok)
    # Offline, as read at import time too: else the hub is asked, and this machine has no network to wait for.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"sft.dataset='nobody/no-such-dataset': could not load it"):
        load_dataset_examples("nobody/no-such-dataset", "train", tok)


def test_the_job_learns_a_dataset_named_on_its_command_line(tiny_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import datasets

    from flywheel.contract.config import RunConfig
    from flywheel_trainer.sft import main

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model_dir)
    datasets.Dataset.from_list([chat(t) for t in ("abc", "dcba", "ef", "ghij")]).save_to_disk(str(tmp_path / "ds"))
    config = tmp_path / "sft.toml"
    config.write_text('run = "ds"\nenv = "reverse_text"\n[sft]\nsteps = 2\nbatch_size = 2\n')
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))
    assert main([str(config), "--dataset", str(tmp_path / "ds")]) == 0
    summary = json.loads((tmp_path / "runs" / "ds" / "summary.json").read_text())
    assert summary["data"] == f"{tmp_path / 'ds'} (split train)" and summary["examples"] == 4
    with pytest.raises(SystemExit):
        main([str(config), "--run-id", "both", "--data", "x.jsonl", "--dataset", "y"])
    assert "--data and --dataset: give one of them" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"sft: Value error, data='a.jsonl' and dataset='b': give one of them"):
        RunConfig.parse({"run": "r", "env": "reverse_text", "sft": {"data": "a.jsonl", "dataset": "b"}})
