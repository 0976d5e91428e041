"""Many LoRA adapters trained on one copy of a base model: what the training API trains.

A :class:`Base` holds one model, its weights frozen, with one named peft adapter per training
model (a session's ``create_model``): each its own rank and targets, its own AdamW state and step
count. Gradients accumulate in an adapter's own parameters across ``forward_backward`` calls
until its ``optim_step``; only the adapter a request names is active while it runs, so one
model's requests never touch another's weights, gradients or optimizer. Requests on one base
run one at a time (its lock); the API orders them (``flywheel_trainer.tinker_api``).

Losses, on each datum's tokens (``model_input``) and per-position ``loss_fn_inputs``, summed over
positions and datums (no mean), as the Tinker SDK documents them:

- ``cross_entropy``: ``-sum(weights * logprobs)`` of ``target_tokens``;
- ``importance_sampling``: ``-sum(exp(logprobs - sampler_logprobs) * advantages)``, the
  sampler's ``logprobs`` of ``target_tokens`` given as an input (the REINFORCE estimate,
  corrected for the sampler being another policy);
- ``ppo``: ``-sum(min(ratio * advantages, clip(ratio, low, high) * advantages))`` with
  ``ratio = exp(logprobs - sampler_logprobs)``;
- ``cispo``: ``-sum(sg(clip(ratio, low, high)) * advantages * logprobs)``: the importance weight
  is clipped and held constant, every token keeps its gradient;
- ``gspo``: ``ppo`` with one ratio a datum, ``exp(mean(logprobs - sampler_logprobs))`` over its
  positions whose advantage is not 0 (the sampled tokens, where the SDK's RL datums put their
  advantages; prompt positions carry 0), each token's gradient that ratio's times its own.

``low`` and ``high`` bound the ratio itself (not ``1 -/+ eps``): the request's ``loss_fn_config``
``clip_low_threshold`` and ``clip_high_threshold``, or per position the datum's inputs of those
names, else :data:`CLIP_DEFAULTS` (0.8 and 1.2 as the SDK documents for ``ppo``; GSPO's paper
clips its sequence ratio far tighter, 1 - 3e-4 to 1 + 4e-4, and so does ``gspo`` by default).

Each returns the model's ``logprobs`` of the targets per datum, and ``loss:sum``.

Sampling (:meth:`Base.sample`) draws from an adapter (a snapshot of a training model's, or one
loaded from a checkpoint) or the base alone, token by token with the model's KV cache, at the
request's temperature, top-k and top-p, until the end-of-sequence token, a stop token or
string, ``max_tokens`` or the context; each token comes with its logprob under the
temperature-scaled distribution it was drawn from (what ``importance_sampling`` takes as the
sampler's ``logprobs``).
Checkpoints (``save``/``load``) hold an adapter's tensors, its config and, optionally, its
optimizer state and step, in one file under the data dir.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flywheel.sdk.models import cache_argument, load_model, resolve_model
from flywheel_trainer import losses

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
               **{name: ("target_tokens", "logprobs", "advantages") for name in LOSSES[1:]}}
CLIPS = ("clip_low_threshold", "clip_high_threshold")  # a clipped loss's bounds of the ratio
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.8, 1.2), "gspo": (1 - 3e-4, 1 + 4e-4)}


class UserError(ValueError):
    """A request this model cannot do as asked; the message says what to change."""


@dataclass
class Datum:
    """One sequence: its tokens and its per-position inputs (arrays of the tokens' length)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class Sampling:
    """How to sample: ``stop_tokens`` None stops at the end-of-sequence token; an empty set never stops early."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_tokens: set[int] | None = None
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int = 0  # the top-k tokens and logprobs of each sampled position (the SDK's topk_sample_logprobs)


@dataclass
class Sampled:
    """One sampled continuation: its tokens, each one's logprob, and why it ended (stop, length)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token, when asked


@dataclass
class PromptScores:
    """What a model makes of a prompt: each token's logprob given those before it (NaN for the
    first, and for those before the last ``last_n`` asked for), and, when asked, each position's
    top-k tokens and logprobs (empty rows where there is no logprob)."""

    logprobs: list[float]
    top: list[tuple[list[int], list[float]]] | None


@dataclass
class Adapter:
    """One training model: an adapter of its base, with its optimizer and step count."""

    name: str
    rank: int
    targets: tuple[str, ...]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending: int = 0  # forward_backward calls since the last optim_step


@dataclass
class Base:
    """One base model and the adapters trained on it (see the module)."""

    name: str
    data_dir: Path
    model: Any = None
    tokenizer: Any = None
    peft: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    context: int = 0

    def __post_init__(self) -> None:
        model, tokenizer = load_model(resolve_model(self.name, self.data_dir))
        for param in model.parameters():
            param.requires_grad_(False)
        self.model, self.tokenizer = model, tokenizer
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)

    def add(self, name: str, rank: int, seed: int | None, train_attn: bool, train_mlp: bool,
            train_unembed: bool) -> Adapter:
        """A new adapter ``name`` (B at zero: it computes what the base does until trained)."""
        present = {n.rsplit(".", 1)[-1] for n, _ in self.model.named_modules()}
        targets = tuple(t for t in (*(ATTN if train_attn else ()), *(MLP if train_mlp else ()),
                                    *(UNEMBED if train_unembed else ())) if t in present)
        if not targets:
            raise UserError(f"lora_config: no layer of {self.name} to train with train_attn={train_attn}, "
                            f"train_mlp={train_mlp}, train_unembed={train_unembed}")
        return self.attach(name, rank, seed, targets)

    def attach(self, name: str, rank: int, seed: int | None, targets: tuple[str, ...]) -> Adapter:
        """A new adapter ``name`` of ``rank`` on ``targets`` (layer names of the base)."""
        from peft import LoraConfig, get_peft_model

        if not 1 <= rank <= 1024:
            raise UserError(f"lora_config.rank={rank}: 1 to 1024")
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), bias="none", lora_dropout=0.0)
        with self.lock:
            if seed is not None:
                torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)  # peft on a tied lm_head
                warnings.filterwarnings("ignore", category=FutureWarning)
                if self.peft is None:
                    self.peft = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self.peft.add_adapter(name, config)
            params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
            optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
            adapter = self.adapters[name] = Adapter(name, rank, targets, params, optimizer)
        return adapter

    def remove(self, name: str) -> None:
        """Let go of adapter ``name`` (its session finished): its weights and optimizer state
        (peft keeps a base's last adapter module until another replaces it)."""
        with self.lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                return
            adapter.optimizer.state.clear()
            if self.adapters:
                with warnings.catch_warnings():  # peft says which adapter it made active instead: any is
                    warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                    self.peft.delete_adapter(name)

    def snapshot(self, adapter: Adapter, name: str) -> Adapter:
        """A new adapter ``name`` holding ``adapter``'s weights as they are now (what a sampler
        samples from while training goes on)."""
        copy = self.attach(name, adapter.rank, None, adapter.targets)
        with self.lock:
            named = dict(self.peft.named_parameters())
            with torch.no_grad():
                for key, param in list(named.items()):
                    if f".{adapter.name}." in key:
                        named[key.replace(f".{adapter.name}.", f".{name}.")].copy_(param)
        return copy

    def sample(self, adapter: Adapter | None, prompt: Sequence[int], num_samples: int, params: Sampling
               ) -> list[Sampled]:
        """``num_samples`` continuations of ``prompt`` from ``adapter`` (None: the base alone),
        each with the logprob of every token under the distribution it was drawn from."""
        if not prompt:
            raise UserError("prompt: no tokens")
        if self.context and len(prompt) >= self.context:
            raise UserError(f"prompt: {len(prompt)} tokens, the model's context is {self.context}")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        stop_tokens = params.stop_tokens if params.stop_tokens is not None else {self.tokenizer.eos_token_id}
        out = []
        with self.lock, torch.no_grad():
            if adapter is None and self.peft is not None:
                with self.peft.disable_adapter():
                    for _ in range(num_samples):
                        out.append(self._draw(self.peft, prompt, params, stop_tokens, generator))
            else:
                model = self.model if self.peft is None else self.peft
                if adapter is not None:
                    self.peft.set_adapter(adapter.name)
                for _ in range(num_samples):
                    out.append(self._draw(model, prompt, params, stop_tokens, generator))
        return out

    def _draw(self, model: Any, prompt: Sequence[int], params: Sampling, stop_tokens: set[int],
              generator: torch.Generator | None) -> Sampled:
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[tuple[list[int], list[float]]] = []
        cache = cache_argument(self.model)  # the name this transformers takes the KV cache by
        past = None
        step = torch.tensor([list(prompt)])
        room = params.max_tokens if not self.context else min(params.max_tokens, self.context - len(prompt))
        for _ in range(room):
            result = model(input_ids=step, use_cache=True, **{cache: past})
            past = getattr(result, cache)
            logits = result.logits[0, -1].float()
            if params.temperature <= 0:
                token = int(logits.argmax())
                logprob = float(torch.log_softmax(logits, -1)[token])
            else:
                scores = torch.log_softmax(logits / params.temperature, -1)
                token = int(torch.multinomial(_truncated(scores, params.top_k, params.top_p).exp(), 1,
                                              generator=generator))
                logprob = float(scores[token])
            tokens.append(token)
            logprobs.append(logprob)
            if params.top_logprobs:
                best = torch.log_softmax(logits / params.temperature if params.temperature > 0 else logits, -1)
                values, ids = best.topk(min(params.top_logprobs, best.shape[-1]))
                top.append((ids.tolist(), values.tolist()))
            if token in stop_tokens or (params.stop_strings and any(
                    self.tokenizer.decode(tokens).endswith(text) for text in params.stop_strings)):
                return Sampled(tokens, logprobs, "stop", top)
            step = torch.tensor([[token]])
        return Sampled(tokens, logprobs, "length", top)

    def score_prompt(self, adapter: Adapter | None, prompt: Sequence[int], top_k: int, last_n: int | None
                     ) -> PromptScores:
        """The prompt's tokens' logprobs under ``adapter`` (None: the base), at temperature 1."""
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise UserError(f"prompt_logprobs_last_n={last_n}: 1 to the prompt's length less one ({len(prompt) - 1})")
        with self.lock, torch.no_grad():
            if adapter is None and self.peft is not None:
                with self.peft.disable_adapter():
                    logits = self.peft(input_ids=torch.tensor([list(prompt)])).logits[0].float()
            else:
                if adapter is not None:
                    self.peft.set_adapter(adapter.name)
                logits = (self.model if self.peft is None else self.peft)(
                    input_ids=torch.tensor([list(prompt)])).logits[0].float()
        scores = torch.log_softmax(logits[:-1], -1)
        given = scores.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        first = len(prompt) - last_n if last_n is not None else 1  # the first position scored
        logprobs = [float("nan")] * first + given[first - 1:]
        top = None
        if top_k:
            values, ids = scores.topk(min(top_k, scores.shape[-1]))
            top = [([], [])] * first + [(i, v) for i, v in zip(ids.tolist()[first - 1:], values.tolist()[first - 1:],
                                                               strict=True)]
        return PromptScores(logprobs, top)

    def _use(self, adapter: Adapter) -> None:
        self.peft.set_adapter(adapter.name)
        for param in adapter.params:  # set_adapter marks the active adapter trainable; ours always are
            param.requires_grad_(True)

    def forward_backward(self, adapter: Adapter, data: Sequence[Datum], loss_fn: str, forward_only: bool,
                         config: dict[str, float] | None = None) -> tuple[list[dict[str, np.ndarray]],
                                                                          dict[str, float]]:
        """Per datum the model's logprobs of its targets; ``loss:sum``. Gradients accumulate
        (unless ``forward_only``) until :meth:`optim_step`. ``config``: the loss's
        ``loss_fn_config``."""
        if loss_fn not in LOSSES:
            raise UserError(f"loss_fn {loss_fn!r}: this server trains with {', '.join(LOSSES)}")
        bounds = _bounds(loss_fn, config or {})
        for i, datum in enumerate(data):
            _check(datum, i, loss_fn, self.context)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with self.lock:
            self._use(adapter)
            for datum in data:
                with torch.set_grad_enabled(not forward_only):
                    logits = self.peft(input_ids=torch.tensor([datum.tokens])).logits[0].float()
                    targets = torch.as_tensor(datum.inputs["target_tokens"], dtype=torch.long)
                    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
                    loss = _loss(loss_fn, logprobs, datum.inputs, bounds)
                    if not forward_only:
                        loss.backward()
                total += float(loss.detach())
                outputs.append({"logprobs": logprobs.detach().numpy().astype(np.float32)})
            if not forward_only:
                adapter.pending += 1
        return outputs, {"loss:sum": total}

    def optim_step(self, adapter: Adapter, learning_rate: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """Apply the gradients accumulated since the last step (AdamW, these hyperparameters)."""
        with self.lock:
            metrics = {}
            if grad_clip_norm > 0:
                metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(adapter.params, grad_clip_norm))
            for group in adapter.optimizer.param_groups:
                group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
            adapter.optimizer.step()
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.steps += 1
            adapter.pending = 0
        return {**metrics, "step": float(adapter.steps)}

    def save(self, adapter: Adapter, path: Path) -> None:
        """The adapter's tensors, config, optimizer state and step, in one file."""
        with self.lock:
            tensors = {n.replace(f".{adapter.name}.", ".{adapter}."): p.detach().clone()
                       for n, p in self.peft.named_parameters() if f".{adapter.name}." in n}
            state = {"base": self.name, "rank": adapter.rank, "targets": list(adapter.targets), "tensors": tensors,
                     "optimizer": adapter.optimizer.state_dict(), "steps": adapter.steps}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        partial.rename(path)

    def load(self, adapter: Adapter, path: Path, optimizer: bool) -> None:
        """Set the adapter to a checkpoint of an adapter of this base with the same rank and
        targets (its optimizer state and step too, when ``optimizer``)."""
        state = torch.load(path, weights_only=True)
        if state["base"] != self.name or state["rank"] != adapter.rank or tuple(state["targets"]) != adapter.targets:
            raise UserError(f"{path.name}: a checkpoint of a rank-{state['rank']} adapter of {state['base']} on "
                            f"{state['targets']}; this model is rank {adapter.rank} of {self.name} on "
                            f"{list(adapter.targets)}")
        with self.lock:
            named = dict(self.peft.named_parameters())
            with torch.no_grad():
                for key, tensor in state["tensors"].items():
                    named[key.replace(".{adapter}.", f".{adapter.name}.")].copy_(tensor)
            if optimizer:
                adapter.optimizer.load_state_dict(state["optimizer"])
                adapter.steps = int(state["steps"])
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.pending = 0


def _truncated(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities with all but the ``top_k`` tokens and those past the ``top_p`` mass
    removed (-inf), renormalised."""
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        mass = ordered.exp().cumsum(-1)
        drop = mass - ordered.exp() > top_p  # keep the tokens until the mass reaches top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scores, -1)


def checkpoint_of(path: Path) -> tuple[str, int, tuple[str, ...]]:
    """(base model, rank, targets) of a checkpoint :meth:`Base.save` wrote."""
    state = torch.load(path, weights_only=True)
    return str(state["base"]), int(state["rank"]), tuple(state["targets"])


def _check(datum: Datum, index: int, loss_fn: str, context: int) -> None:
    n = len(datum.tokens)
    if n == 0:
        raise UserError(f"data[{index}]: no tokens")
    if context and n > context:
        raise UserError(f"data[{index}]: {n} tokens, past the model's context of {context}")
    for name in (*LOSS_INPUTS[loss_fn], *(CLIPS if loss_fn in CLIP_DEFAULTS else ())):
        if name not in datum.inputs:
            if name in CLIPS:
                continue  # a bound given per position is optional (loss_fn_config or the default)
            raise UserError(f"data[{index}].loss_fn_inputs: {loss_fn} needs {name!r} (it has "
                            f"{sorted(datum.inputs)})")
        if datum.inputs[name].shape != (n,):
            raise UserError(f"data[{index}].loss_fn_inputs[{name!r}]: shape {list(datum.inputs[name].shape)}, not "
                            f"[{n}] (one a token of model_input)")


def _bounds(loss_fn: str, config: dict[str, float]) -> tuple[float, float]:
    """A clipped loss's bounds of the ratio from its ``loss_fn_config``; a key no loss of this
    server reads is refused (a typo would otherwise train with the default silently)."""
    known = CLIPS if loss_fn in CLIP_DEFAULTS else ()
    for key in config:
        if key not in known:
            raise UserError(f"loss_fn_config[{key!r}]: {loss_fn} reads " + (
                f"{' and '.join(known)}" if known else "no loss_fn_config"))
    low, high = (float(config.get(name, default)) for name, default in zip(CLIPS, CLIP_DEFAULTS.get(loss_fn, (0, 0)),
                                                                           strict=True))
    if loss_fn in CLIP_DEFAULTS and not 0 <= low <= 1 <= high:
        raise UserError(f"loss_fn_config: clip_low_threshold={low}, clip_high_threshold={high}: the ratio's bounds, "
                        "0 <= low <= 1 <= high (e.g. 0.8 and 1.2)")
    return low, high


def _loss(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, np.ndarray], bounds: tuple[float, float]
          ) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        weights = torch.as_tensor(inputs["weights"], dtype=torch.float32)
        return -(weights * logprobs).sum()
    sampler = torch.as_tensor(inputs["logprobs"], dtype=torch.float32)
    advantages = torch.as_tensor(inputs["advantages"], dtype=torch.float32)
    if loss_fn == "importance_sampling":
        return -(torch.exp(logprobs - sampler) * advantages).sum()
    low, high = (torch.as_tensor(inputs[name], dtype=torch.float32) if name in inputs else bound
                 for name, bound in zip(CLIPS, bounds, strict=True))
    if loss_fn == "ppo":
        return losses.ratio_clipped(torch.exp(logprobs - sampler), advantages, low, high)[0].sum()
    if loss_fn == "cispo":
        return losses.cispo(logprobs, sampler, advantages, low, high)[0].sum()
    return losses.gspo(logprobs, sampler, advantages, low, high, (advantages != 0).float())[0].sum()
