"""Chats and trace API exports as sequences to learn: what ``flywheel sft`` and a warm-up on
``sft.data`` or ``sft.dataset`` train on (see :mod:`flywheel_trainer.sft` for the file's lines;
a ``datasets`` dataset's rows are the same).

A chat's assistant messages are each one sequence: the messages before it as the model's chat
template renders them with a generation prompt (the context inference gives), then the
message as the template ends it, learned up to and with its end of turn. An export line with
its token layer is learned exactly as it was sampled; an export's closing ``{"end": ...}``
line is skipped and its ``{"error": ...}`` line (the gateway cut it) refused. Every line that
cannot be learned is a :class:`DataError` naming its file and line and what to do.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from flywheel.contract import events
from flywheel.contract.config import SFTConfig
from flywheel.sdk import models
from flywheel.sdk.messages import message_from_dict
from flywheel_trainer.join import Tokens


class DataError(ValueError):
    """A line of the data file that cannot be learned from, with its place and what to do."""


def _message(d: Any, where: str) -> events.Message:
    """A message in the OpenAI shape, or as the trace API exports it (tool calls flat)."""
    if isinstance(d, Mapping) and any(isinstance(c, Mapping) and "function" not in c
                                      for c in d.get("tool_calls") or []):
        calls = [{"id": c.get("id"), "function": {"name": c.get("name"), "arguments": c.get("arguments", "{}")}}
                 for c in d["tool_calls"]]
        d = {**d, "tool_calls": calls}
    return message_from_dict(d, where)


def chat_examples(tok: Any, messages: Sequence[events.Message], tools: Sequence[dict[str, Any]] | None,
                  where: str) -> list[Tokens]:
    """One sequence per assistant message of a chat: the messages before it rendered with a
    generation prompt (the context inference gives), then the message as the template ends it,
    learned."""
    out = []
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        if i == 0:
            raise DataError(f"{where}: the chat starts with an assistant message; nothing comes before it to "
                            "answer (start with a system or user message)")
        prompt = models.render_text(tok, messages[:i], tools, generation_prompt=True)
        whole = models.render_text(tok, messages[:i + 1], tools)
        if not whole.startswith(prompt):
            raise DataError(f"{where}: the model's chat template does not render message {i} after the ones before "
                            "it as it renders them alone; this chat cannot be learned with this model")
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        answer_ids = tok.encode(whole[len(prompt):], add_special_tokens=False)
        if tok.eos_token_id in answer_ids:  # the template's end of turn: learned; what follows it is scaffolding
            answer_ids = answer_ids[:answer_ids.index(tok.eos_token_id) + 1]
        if not answer_ids:
            continue
        out.append(Tokens(prompt_ids + answer_ids, [0.0] * (len(prompt_ids) + len(answer_ids)),
                          [False] * len(prompt_ids) + [True] * len(answer_ids)))
    return out


def _closing(row: Mapping[str, Any]) -> str | None:
    """``"end"`` or ``"error"`` for a trace API export's last line (``{"end": {"num_rollouts":
    N}}`` of a complete export, ``{"error": ...}`` of one the gateway cut), None for any other
    line. Neither has an ``id`` nor ``messages``; a dataset's rows hold every column, null where
    a line had none, so the keys alone do not tell."""
    if row.get("id") is not None or row.get("messages") is not None:
        return None
    if row.get("error") is not None:
        return "error"
    return "end" if row.get("end") is not None else None


def line_examples(tok: Any, row: Any, where: str) -> list[Tokens]:
    """The sequences of one line of the data file (see the module's docstring)."""
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a {type(row).__name__}, not an object with 'messages'")
    closing = _closing(row)
    if closing == "error":
        raise DataError(f"{where}: the export was cut: {row['error']} (export again)")
    if closing == "end":
        return []  # a complete export's last line: nothing to learn
    tokens = row.get("tokens")
    if isinstance(tokens, Mapping) and tokens.get("token_ids"):
        ids, mask = tokens["token_ids"], tokens.get("loss_mask") or []
        if len(mask) != len(ids) or not all(isinstance(t, int) for t in ids):
            raise DataError(f"{where}.tokens: token_ids and loss_mask differ in length or hold other than integers")
        if mask[0]:
            raise DataError(f"{where}.tokens: the first token is marked for the loss, but nothing predicts it")
        if not any(mask):
            return []
        return [Tokens(list(ids), [0.0] * len(ids), [bool(m) for m in mask])]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: no 'messages' (a chat in the OpenAI shape, or a trace API export line)")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}.tools: a list of OpenAI function specs, not a {type(tools).__name__}")
    try:
        chat = [_message(m, f"{where}.messages[{i}]") for i, m in enumerate(messages)]
    except ValueError as exc:
        raise DataError(str(exc)) from None
    return chat_examples(tok, chat, tools, where)


def load_examples(path: Path, tok: Any, max_positions: int | None = None, field: str = "sft.data") -> list[Tokens]:
    """Every sequence of the data file (the config's ``field``); DataError naming the line for one
    that cannot be learned."""
    if not path.exists():
        raise DataError(f"{field}={str(path)!r}: no such file (a JSON Lines file of chats or a trace API export)")
    examples: list[Tokens] = []
    kinds: set[str | None] = set()  # an export of nothing is its end line alone
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
            examples += _fitting(line_examples(tok, row, where), max_positions, where)
            kinds.add(_closing(row))
    if not examples and kinds == {"end"}:
        raise DataError(f"{field}={str(path)!r}: an export of no rollouts (its end line alone); export again with "
                        "filters that keep some")
    if not examples:
        raise DataError(f"{field}={str(path)!r}: no assistant message to learn from in any line")
    return examples


def load_dataset_examples(name: str, split: str, tok: Any, max_positions: int | None = None,
                          field: str = "sft.dataset") -> list[Tokens]:
    """Every sequence of a ``datasets`` dataset's ``split``, each row as a line of a data file
    (:func:`line_examples`); DataError naming the row for one that cannot be learned, and the
    dataset for one that cannot be loaded."""
    rows = open_dataset(name, split, field)
    examples: list[Tokens] = []
    for index, row in enumerate(rows):
        where = f"{name}[{split}][{index}]"
        examples += _fitting(line_examples(tok, row, where), max_positions, where)
    if not examples:
        raise DataError(f"{field}={name!r} (split {split!r}): no assistant message to learn from in any row")
    return examples


def open_dataset(name: str, split: str, field: str = "sft.dataset") -> Any:
    """The rows of ``split`` of the dataset ``name``: a folder :meth:`datasets.Dataset.save_to_disk`
    wrote (a dataset, or a dict of splits), else whatever :func:`datasets.load_dataset` takes (a
    hub id, a folder of JSON Lines or Parquet files). DataError saying why it cannot be loaded."""
    import datasets

    path = Path(name).expanduser()
    saved = path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json"))
    try:
        if saved:
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{field}={name!r}: no split {split!r}; it has {', '.join(loaded)} "
                                    f"({_split_field(field)})")
                return loaded[split]
            return loaded
        return datasets.load_dataset(name, split=split)
    except DataError:
        raise
    except ValueError as exc:  # datasets' unknown split
        raise DataError(f"{field}={name!r}, split {split!r}: {exc} ({_split_field(field)})") from None
    except Exception as exc:  # datasets raises many kinds (not found, offline, bad files): each is the user's to fix
        raise DataError(f"{field}={name!r}: could not load it ({type(exc).__name__}: {exc}); give a hub id this "
                        "machine can reach, a folder that Dataset.save_to_disk wrote, a folder of JSON Lines or "
                        "Parquet files, or a JSON Lines file as sft.data") from None


def _split_field(field: str) -> str:
    """The config field that picks the split of the dataset named in ``field`` (its sibling)."""
    return field.rsplit(".", 1)[0] + ".split"


def _fitting(examples: list[Tokens], max_positions: int | None, where: str) -> list[Tokens]:
    """``examples``, refused with ``where`` when one is longer than the model's positions."""
    for example in examples:
        if max_positions is not None and len(example.token_ids) > max_positions:
            raise DataError(f"{where}: {len(example.token_ids)} tokens, more than the model's "
                            f"{max_positions} positions; shorten it or use a model with a longer context")
    return examples


def sft_examples(sft: SFTConfig, tok: Any, max_positions: int | None) -> list[Tokens]:
    """The examples of ``[sft]``'s ``data`` file or ``dataset`` (one of them is set)."""
    if sft.dataset:
        return load_dataset_examples(sft.dataset, sft.split, tok, max_positions)
    assert sft.data, "sft.data or sft.dataset"
    return load_examples(Path(sft.data), tok, max_positions)


def batches(num_examples: int, batch_size: int, seed: int) -> Iterator[tuple[int, list[int]]]:
    """(epoch, indices) of each step: the examples shuffled anew each epoch, a batch never
    crossing an epoch's end unless the data is smaller than one batch."""
    rng = random.Random(seed)
    epoch = 0
    while True:
        order = list(range(num_examples))
        rng.shuffle(order)
        if num_examples <= batch_size:
            yield epoch, order
        else:
            for start in range(0, num_examples - batch_size + 1, batch_size):
                yield epoch, order[start:start + batch_size]
        epoch += 1
