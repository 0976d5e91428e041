"""``flywheel export``: a run's checkpoint as a Hugging Face folder that ``transformers`` loads as it
is, with the trainer's logprobs.

The run folder is written as the trainer writes it: its config, and checkpoints made by the
torch engine after real optimizer steps (:meth:`Checkpoints.write`, the trainer's own path).
The command runs as a user types it (a subprocess); the folder is loaded with
``AutoModelForCausalLM.from_pretrained``; 20 completions sampled from it get, token by token,
the logprobs the trainer's model gives them (within 1e-3), and not the base model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flywheel.contract.checkpoints import Checkpoints, CheckpointState, run_folder
from flywheel.contract.config import RunConfig
from flywheel.sdk import models
from flywheel_trainer.engines import TorchEngine, with_adapter

ROOT = Path(__file__).parents[2]
RUN = "export-me"
NUM_COMPLETIONS = 20


def flywheel(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """Logprob of each completion token (positions from ``num_prompt`` on) given what precedes it."""
    with torch.no_grad():
        logits = model(ids).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logprobs[:, num_prompt - 1:]


def train_a_little(engine: TorchEngine, tok: object, steps: int) -> None:
    """Real optimizer steps (next-token loss on a few texts), so the weights leave the base model's."""
    texts = ["Reverse the text: hello -> olleh", "Reverse the text: flywheel -> leehwylf"]
    for _ in range(steps):
        for text in texts:
            ids = torch.tensor([tok.encode(text)])  # type: ignore[attr-defined]
            loss = engine.model(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()


@pytest.mark.timeout(600)
@pytest.mark.long
def test_an_exported_run_loads_in_transformers_with_the_trainers_logprobs(tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data_dir = tmp_path / "data"
    cfg = RunConfig.parse({"run": RUN, "env": "reverse_text", "model": {"name": str(tiny_model_dir)},
                           "trainer": {"lr": 3e-3, "keep_checkpoints": 2}})
    folder = run_folder(data_dir, RUN)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg.model_dump()))
    model, tok = models.load_model(tiny_model_dir, "float32")
    base, _ = models.load_model(tiny_model_dir, "float32")
    engine = TorchEngine(model, cfg.trainer, "float32")
    checkpoints = Checkpoints(folder / "checkpoint", keep=cfg.trainer.keep_checkpoints)
    for step in (1, 2, 3):
        train_a_little(engine, tok, 2)
        checkpoints.write(CheckpointState(step=step, version=step), engine.weights(), engine.save)
    assert checkpoints.steps() == [2, 3]

    out = tmp_path / "exported"
    done = flywheel("export", RUN, str(out), "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"exported run {RUN} at step 3" in done.stdout
    provenance = json.loads((out / "flywheel-export.json").read_text())
    assert provenance["step"] == 3 and provenance["version"] == 3 and provenance["run"] == RUN
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    exported_tok = AutoTokenizer.from_pretrained(out)
    assert exported_tok.chat_template == tok.chat_template
    chat = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "flywheel"}]
    text = exported_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids: list[int] = exported_tok.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    prompt = torch.tensor([ids])
    torch.manual_seed(0)
    sampled = exported.generate(prompt.repeat(NUM_COMPLETIONS, 1), do_sample=True, max_new_tokens=12,
                                min_new_tokens=12, pad_token_id=exported_tok.pad_token_id)
    mine = token_logprobs(exported, sampled, prompt.shape[1])
    trainers = token_logprobs(engine.module, sampled, prompt.shape[1])
    bases = token_logprobs(base, sampled, prompt.shape[1])
    assert mine.shape == (NUM_COMPLETIONS, 12)
    assert (mine - trainers).abs().max().item() <= 1e-3
    assert (mine - bases).abs().max().item() > 1e-2  # the trained weights, not the base model's

    # An older kept step; one not kept, a run that is not there, a folder in use: refused, naming what to fix.
    older = tmp_path / "step2"
    done = flywheel("export", RUN, str(older), "--step", "2", "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((older / "flywheel-export.json").read_text())["step"] == 2
    done = flywheel("export", RUN, str(tmp_path / "step1"), "--step", "1", "--data-dir", str(data_dir))
    assert done.returncode == 1 and "--step 1" in done.stderr and "steps 2, 3 only" in done.stderr
    assert not (tmp_path / "step1").exists()
    done = flywheel("export", "no-such-run", str(tmp_path / "none"), "--data-dir", str(data_dir))
    assert done.returncode == 1 and "'no-such-run'" in done.stderr and "--data-dir" in done.stderr
    done = flywheel("export", RUN, str(out), "--data-dir", str(data_dir))
    assert done.returncode == 1 and "not an empty folder" in done.stderr


@pytest.mark.timeout(600)
@pytest.mark.long
def test_a_lora_run_exports_a_peft_adapter_folder_or_the_merged_model_with_the_trainers_logprobs(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data_dir = tmp_path / "data"
    cfg = RunConfig.parse({"run": RUN, "env": "reverse_text", "model": {"name": str(tiny_model_dir)},
                           "trainer": {"lr": 3e-2, "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj",
                                                                                                        "up_proj"]}}})
    folder = run_folder(data_dir, RUN)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg.model_dump()))
    model, tok = models.load_model(tiny_model_dir, "float32")
    engine = TorchEngine(with_adapter(model, cfg.trainer), cfg.trainer, "float32")
    train_a_little(engine, tok, 3)
    Checkpoints(folder / "checkpoint").write(CheckpointState(step=1, version=1), engine.weights(), engine.save)

    done = flywheel("export", RUN, str(tmp_path / "adapter"), "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "its LoRA adapter" in done.stdout
    assert json.loads((tmp_path / "adapter" / "flywheel-export.json").read_text())["kind"] == "adapter"
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapted = PeftModel.from_pretrained(models.load_model(tiny_model_dir, "float32")[0], tmp_path / "adapter").eval()
    done = flywheel("export", RUN, str(tmp_path / "merged"), "--merged", "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base, _ = models.load_model(tiny_model_dir, "float32")

    ids = torch.tensor([tok.encode("Reverse the text: flywheel -> leehwylf")])
    trainers = token_logprobs(engine.module, ids, 4)
    for exported in (adapted, merged):
        assert (token_logprobs(exported, ids, 4) - trainers).abs().max().item() <= 1e-4
    assert (token_logprobs(base, ids, 4) - trainers).abs().max().item() > 1e-2  # the adapter moved it
