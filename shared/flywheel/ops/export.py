"""``flywheel export RUN [--step N] DIR``: a run's weights as a standard Hugging Face folder.

The folder holds what ``transformers`` (``AutoModelForCausalLM.from_pretrained``) and vLLM
load as they are: ``config.json`` and ``generation_config.json``, the weights as
``model.safetensors``, the tokenizer with its chat template. The weights are those of a
checkpoint the run's trainer kept (``trainer.keep_checkpoints``, newest by default; see
:mod:`flywheel.contract.checkpoints`), exactly as it published them, in float32 as it
trained them, put into the run's base model (``model.name`` of the run's config) and
saved by ``save_pretrained``: the same logprobs as the trainer computed.

A LoRA run (``trainer.adapter``) exports its adapter as a standard peft folder instead
(``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer):
``PeftModel.from_pretrained(base, DIR)`` loads it over the base model; ``merged=True``
(``--merged``) writes the base model with the adapter merged in, a plain model folder.

Beside them, ``flywheel-export.json`` says where they come from: run, step, weights
version, the sha256 of the weights, environment and base model.

Read from ``<data_dir>/runs/<run>/``: ``config.json`` (written when the run starts) and the
checkpoint folder. No bus is needed: a run can be exported on the machine that holds its
folder, while it runs or long after.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.contract.checkpoints import WEIGHTS_FILE, Checkpoints, run_folder
from flywheel.contract.config import RunConfig

PROVENANCE_FILE = "flywheel-export.json"


def export(run: str, out_dir: str | Path, data_dir: str | Path, step: int | None = None,
           merged: bool = False, trusted_modules: Sequence[str] = ()) -> dict[str, Any]:
    """Write run ``run``'s weights at ``step`` (None: its newest checkpoint) to ``out_dir`` as a
    Hugging Face model folder (a LoRA run's: an adapter folder, unless ``merged``); returns what
    ``flywheel-export.json`` says.

    ValueError, naming what is missing, for a run folder or a step that is not there, and for
    an ``out_dir`` that exists and is not empty (nothing is overwritten)."""
    folder = run_folder(data_dir, run)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; name a new folder to export into")
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(f"run {run!r}: no {config_path} (data_dir={str(data_dir)!r}); is it a training run of this "
                         "data folder? Give --data-dir of the machine that ran it")
    cfg = RunConfig.parse(json.loads(config_path.read_text()), source=str(config_path), trusted_modules=trusted_modules)
    checkpoints = Checkpoints(folder / "checkpoint")
    kept = checkpoints.steps()
    if not kept:
        raise ValueError(f"run {run!r} has no checkpoint in {checkpoints.folder} yet (its trainer writes the first "
                         "once it has loaded the model)")
    found = checkpoints.latest() if step is None else checkpoints.at(step)
    if found is None:
        raise ValueError(f"--step {step}: run {run!r} keeps checkpoints of steps {', '.join(map(str, kept))} only "
                         f"(trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} newest, every "
                         f"trainer.checkpoint_every={cfg.trainer.checkpoint_every} steps)")
    path, state = found
    weights_path = path / WEIGHTS_FILE
    if not weights_path.exists():
        raise ValueError(f"checkpoint {path} has no {WEIGHTS_FILE} (written by a trainer before exports existed); "
                         "export a later step")
    data = weights_path.read_bytes()
    provenance = {"run": run, "step": state.step, "version": state.version,
                  "weights_sha256": hashlib.sha256(data).hexdigest(), "env": cfg.env, "base_model": cfg.model.name}
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then renamed: a folder that exists is a complete export.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        provenance["kind"] = _write(cfg, data_dir, data, tmp, merged)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance


def _write(cfg: RunConfig, data_dir: str | Path, data: bytes, out: Path, merged: bool) -> str:
    """The folder's files; what it holds: "model", "adapter" or "merged"."""
    from flywheel.sdk import models

    model, tok = models.load_model(models.resolve_model(cfg.model.name, data_dir), "float32")
    tok.save_pretrained(out)
    if models.is_adapter(data) and not merged:
        models.write_adapter_folder(data, out, cfg.model.name)
        return "adapter"
    models.load_weights(model, data)
    model.save_pretrained(out, safe_serialization=True)
    return "merged" if models.is_adapter(data) else "model"
