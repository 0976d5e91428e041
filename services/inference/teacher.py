"""Teachers: models a run names in ``[teachers.<name>]``, hosted here, whose logprobs of the
policy's sampled tokens go out as :class:`flywheel.contract.events.Signal` events (SIGNALS).

- What a signal holds (:func:`teacher_signals`, pure): for each branch of a rollout's trace
  graph, its tokens joined in node order are one sequence (a row) of the teacher's forward,
  and token ``t`` gets ``log_softmax(logits[t - 1] / temperature)[token t]`` in float32, at
  the temperature the rollout was sampled with (the run's ``[sampling]`` where the rollout
  does not say), the first token of a sequence 0.0. Only nodes holding sampled tokens get
  values, one per token of their span (0.0 where the loss mask is off), and a node shared by
  several branches gets them once: its context is its ancestors, the same in every branch,
  so the first branch that reaches it computes them (a branch is cut after the last node it
  still has to compute).
- How it is computed (:func:`_forward`): rows in passes of at most ``max_batch_size``, rows
  that begin with the same prompt side by side (a group's samples, a rollout's retries).
  Within a pass, what rows share (all before the context of their first value: the prompt
  but its last token) is run once, left-padded, and each row goes on from a copy of its
  keys and values, right-padded and without its last token (only a target); logits are kept
  from the first position that predicts a value, and the log-softmax is taken only where a
  value is read. The values are those of
  a plain forward on each whole row (the tests hold them to 1e-4). A model whose forward
  takes no positions, cache or ``logits_to_keep`` (not a transformers causal LM) is run on
  whole rows, right-padded, as the trainer does.
- Top-k (a dense on-policy distillation term reads the teacher:
  :meth:`flywheel.contract.config.RunConfig.top_k_of`): at each valued position the ``k``
  largest entries of the same log-softmax and their token ids, likeliest first, beside the
  value (``Signal.top_ids``, ``Signal.top_logprobs``).
- Privileged context (``context``, self-distillation): the first request's prompt (the
  nodes before the first sampled one, and that node's tokens before its first sampled
  token: the generation prompt) is replaced by the render of ``[system: context with
  {answer}] + env.prompt_messages(task)``; the rest of the branch follows unchanged, so
  every value is keyed as without context, its positions shifted. A rollout whose prompt is
  not the render of ``env.prompt_messages(task)`` (a harness that changed its prompt, or
  offered tools, which the render does not know of) gets a signal with an error saying so.
- Models: a name as ``model.name`` takes it, loaded once per (model, dtype) in this process
  and shared by runs; or ``policy``, the run's own model with the weights of ``version``
  from its weight updates (watched on ``weights.<run>``), or with its newest weights, swapped
  between batches (never during one). Each model has one lock: one batch or weight swap at a
  time, the forward on the compute thread so the event loop goes on.
- Hosting (:class:`TeacherHost`, a task of the inference Service): every run that has not
  ended and whose config names teachers gets one durable pull consumer per teacher,
  ``teacher-<run>-<name>`` on ROLLOUTS, filtered on the environments whose training reads
  that teacher (:meth:`flywheel.contract.config.RunConfig.teachers_of`); replicas share it, so
  teachers scale as scorers do. A run that ends stops its consumers, and its durables expire
  :data:`flywheel.contract.runs.LET_GO_S` later (each replica sets it; one left by a host that
  died expires after an hour unused).
  The heartbeat's ``info["teachers"][run][name]`` counts signals, errors, tokens through the
  forward, sampled tokens valued and seconds busy.

Failures: a rollout whose token layer is inconsistent is dead-lettered (Reject); one with
status ``error`` is acked without a signal (the trainer drops it anyway). A signal carries an
error (and no values) when the rollout cannot be valued: a signal larger than the bus takes
(:func:`fit_payload`), a sequence longer than the teacher's positions, a token outside its
vocabulary, a changed prompt under a context, an environment whose reference answer or prompt
fails, a weights version that is no longer in the run's bucket or does not verify. A version
not published yet is waited for, logged every ``WAIT_LOG_S`` (the consumer keeps the
deliveries alive meanwhile). Anything else (a model that does not load, the bus) fails the
delivery, which the bus retries with backoff before dead-lettering it. A teacher's consumer
that dies stops the host, and the process with it. Delivery is at least once: a signal's id is
``<rollout>.<teacher>``, so a rollout valued twice is stored once. Not covered: a teacher whose
tokenizer differs from the policy's (its values would be of other tokens; only a vocabulary too small is caught).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus, Consumer, Delivery, PayloadTooLarge, Reject, wait_at_most, watch
from flywheel.contract.config import RunConfig, TeacherConfig
from flywheel.contract.runs import (
    DURABLE_INACTIVE_S,
    ENDED_STATUSES,
    end_of,
    let_run_durables_go,
    teacher_durable,
    watch_runs,
)
from flywheel.contract.service import compute
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.channel import RemoteError
from flywheel.runtime.environments import WorkerError, WorkerPool
from flywheel.runtime.runs import RunEnvironment, load_run_environments
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.tracegraph import TokenLayerError, branches, join_tokens

log = logging.getLogger(__name__)

POLICY = "policy"  # TeacherConfig.model naming the run's own weights
WAIT_LOG_S = 30.0  # how often a teacher waiting for weights says so
CHECK_S = 1.0  # how often hosted runs are checked for an expired owner's lease
WEIGHTS_WATCHER = "inference-weights"  # as the worker's weights watcher: a bad update is dead-lettered once


# --- values -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """A rollout's first prompt as the student was given it, and the teacher's in its place."""

    student: list[int]
    teacher: list[int]


@dataclass(frozen=True)
class Request:
    """One rollout to value: at ``temperature``, with a privileged ``context`` or none;
    ``error``: known not to be valuable (its signal says why, nothing is computed)."""

    rollout: events.Rollout
    temperature: float
    context: Context | None = None
    error: str | None = None


@dataclass
class Usage:
    """What a call of :func:`teacher_signals` computed."""

    num_tokens: int = 0  # of the rows through the forward (a shared prompt counted in each, as the trainer does)
    num_sampled_tokens: int = 0  # valued: sampled tokens of the nodes that got values


@dataclass
class _Row:
    request: int  # index into the requests
    token_ids: list[int]
    temperature: float
    starts: list[tuple[events.Node, int]]  # each node it computes, with the position of its span's first token
    # the positions it values, ascending: each sampled token of those nodes' spans (but position 0, valued 0.0)
    needed: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.needed = [start + j for node, start in self.starts if node.tokens is not None
                       for j, sampled in enumerate(node.tokens.loss_mask) if sampled and start + j > 0]

    def prefix_length(self) -> int:
        """How many leading tokens rows beginning the same way can share: all before the
        context of its first value (the logits that predict it are the remainder's)."""
        return max(self.needed[0] - 1, 0) if self.needed else 0


def context_of(tok: Any, student: Sequence[events.Message], teacher: Sequence[events.Message]) -> Context:
    """The first prompt of a rollout's task as rendered by ``tok``: its environment's first
    messages (``student``), and the same with the teacher's context (a system message first,
    ``{answer}`` the environment's reference answer: ``teacher``), both from the environment's
    worker (:meth:`flywheel.runtime.environments.WorkerEnvironment.privileged_messages`)."""
    from flywheel.sdk import models

    return Context(models.render_prompt(tok, list(student)), models.render_prompt(tok, list(teacher)))


def _rows(index: int, request: Request) -> list[_Row]:
    """The sequences that value ``request``'s rollout: one per branch that reaches a sampled node
    no branch before it computed. ValueError (the signal's error) when its prompt is not the
    context's student prompt."""
    rollout, context = request.rollout, request.context
    sampled = {n.id for n in rollout.nodes if n.tokens is not None and any(n.tokens.loss_mask)}
    done: set[str] = set()
    rows = []
    for whole in branches(rollout.nodes):
        todo = [i for i, n in enumerate(whole) if n.id in sampled and n.id not in done]
        if not todo:
            continue
        branch = whole[:todo[-1] + 1]
        starts: dict[int, int] = {}
        ids: list[int] = []
        begin = 0
        if context is not None:
            first = next(i for i, n in enumerate(branch) if n.id in sampled)
            span = branch[first].tokens
            assert span is not None  # a sampled node has tokens
            k = span.loss_mask.index(True)  # its generation prompt ends here
            if join_tokens(branch[:first]).token_ids + span.token_ids[:k] != context.student:
                raise ValueError(f"rollout {rollout.id}: its first prompt is not the render of the environment's "
                                 "prompt_messages(task) (its harness changed the prompt or offered tools), so the "
                                 "teacher's context cannot replace it")
            ids = list(context.teacher)
            # Its first k tokens (not sampled) are replaced by the teacher's prompt: their positions
            # fall inside it and are never read (they are valued 0.0).
            starts[first] = len(ids) - k
            ids += span.token_ids[k:]
            begin = first + 1
        for i in range(begin, len(branch)):
            starts[i] = len(ids)
            tokens = branch[i].tokens
            ids += tokens.token_ids if tokens is not None else []
        rows.append(_Row(index, ids, request.temperature, [(branch[i], starts[i]) for i in todo]))
        done.update(branch[i].id for i in todo)
    return rows


# Float32 logits one slice of the log-softmax holds at most (a model of 150k tokens: ~900 positions).
LOG_SOFTMAX_ELEMENTS = 1 << 27


def can_share_prefixes(model: Any) -> bool:
    """Whether ``model`` can go on from a computed prefix: its forward takes explicit positions,
    a key/value cache and ``logits_to_keep`` (every transformers causal LM does; a model of the
    user's own may not, and is then run on whole rows). The trainer decides the same way."""
    from flywheel.sdk import models

    params = models.forward_params(model)
    return {"position_ids", "use_cache", "logits_to_keep"} <= params.keys() and (
        "cache" in params or "past_key_values" in params)


@dataclass
class _Computed:
    """A row's values at its ``needed`` positions, in order, and with a top-k, the ``k``
    likeliest tokens at each of those positions and their logprobs, likeliest first."""

    values: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def _forward(model: Any, rows: Sequence[_Row], max_batch_size: int, top_k: int = 0) -> list[_Computed]:
    """Each row's values at its ``needed`` positions, in order: ``log_softmax(logits[t - 1] /
    temperature)[token t]`` (float32), in forward passes of at most ``max_batch_size`` rows,
    those that begin the same way side by side, longest first (see the module docstring);
    with ``top_k``, the ``top_k`` largest entries of the same log-softmax too."""
    import torch

    from flywheel.sdk import models

    device = next(model.parameters()).device
    share = can_share_prefixes(model)
    # Whole rows keep no cache (use_cache=False where the forward takes it).
    whole = {"use_cache": False} if share or "use_cache" in models.forward_params(model) else {}
    keys = [tuple(row.token_ids[:row.prefix_length()]) if share else () for row in rows]
    families: dict[tuple[int, ...], list[int]] = {}
    for i in sorted((i for i, row in enumerate(rows) if row.needed), key=lambda i: -len(rows[i].token_ids)):
        families.setdefault(keys[i], []).append(i)
    order = [i for family in families.values() for i in family]  # families by their longest member
    out = [_Computed() for _ in rows]
    with torch.no_grad():
        for at in range(0, len(order), max_batch_size):
            chunk = order[at:at + max_batch_size]
            distinct = list(dict.fromkeys(keys[i] for i in chunk))
            # Each row from the end of its prefix (0: whole) to the context of its last value (the
            # last value's token is only a target), right-padded.
            begins = [len(keys[i]) for i in chunk]
            width = max(rows[i].needed[-1] - begin for i, begin in zip(chunk, begins, strict=True))
            input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            at_row, at_column, targets, temperatures = [], [], [], []
            for b, (i, begin) in enumerate(zip(chunk, begins, strict=True)):
                row = rows[i]
                end = row.needed[-1]
                input_ids[b, :end - begin] = torch.tensor(row.token_ids[begin:end], dtype=torch.long)
                mask[b, :end - begin] = 1
                at_row += [b] * len(row.needed)
                at_column += [p - 1 - begin for p in row.needed]
                targets += [row.token_ids[p] for p in row.needed]
                temperatures += [row.temperature] * len(row.needed)
            input_ids, mask = input_ids.to(device), mask.to(device)
            num_logits = width - min(at_column)  # from the first column that predicts a value
            if not share:
                logits = model(input_ids=input_ids, attention_mask=mask, **whole).logits
            elif not any(distinct):
                logits = model(input_ids=input_ids, attention_mask=mask, logits_to_keep=num_logits, **whole).logits
            else:
                logits = _after_prefixes(model, [keys[i] for i in chunk], distinct, input_ids, mask, num_logits)
            index_b = torch.tensor(at_row, dtype=torch.long, device=device)
            index_c = torch.tensor(at_column, dtype=torch.long, device=device) - (width - logits.shape[1])
            target_ids = torch.tensor(targets, dtype=torch.long, device=device)[:, None]
            scale = torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None]
            step = max(1, LOG_SOFTMAX_ELEMENTS // logits.shape[-1])
            k = min(top_k, logits.shape[-1])
            picked, top_values, top_indices = [], [], []
            for lo in range(0, len(at_row), step):  # a bounded slice of float32 logits at a time
                scaled = logits[index_b[lo:lo + step], index_c[lo:lo + step]].float() / scale[lo:lo + step]
                normalizer = scaled.logsumexp(-1)
                picked.append(scaled.gather(-1, target_ids[lo:lo + step]).squeeze(-1) - normalizer)
                if k:
                    top = scaled.topk(k, dim=-1)
                    top_values.append(top.values - normalizer[:, None])
                    top_indices.append(top.indices)
            values = torch.cat(picked).tolist()
            tops = (torch.cat(top_indices).tolist(), torch.cat(top_values).tolist()) if k else ([], [])
            taken = 0
            for i in chunk:
                n = len(rows[i].needed)
                out[i].values = values[taken:taken + n]
                if k:
                    out[i].top_ids, out[i].top_logprobs = tops[0][taken:taken + n], tops[1][taken:taken + n]
                taken += n
    return out


def _after_prefixes(model: Any, row_keys: list[tuple[int, ...]], distinct: list[tuple[int, ...]],
                    input_ids: Any, mask: Any, num_logits: int) -> Any:
    """The last ``num_logits`` columns' logits of the rows (``input_ids``, right-padded), each going
    on from its prefix (``row_keys``; ``distinct``: those prefixes, each computed once)."""
    import torch

    from flywheel.sdk import models

    device = input_ids.device
    longest = max(len(key) for key in distinct)
    prefix_ids = torch.zeros((len(distinct), longest), dtype=torch.long)
    prefix_mask = torch.zeros((len(distinct), longest), dtype=torch.long)
    for f, key in enumerate(distinct):  # left-padded: each ends where its rows go on
        if key:
            prefix_ids[f, longest - len(key):] = torch.tensor(key, dtype=torch.long)
            prefix_mask[f, longest - len(key):] = 1
    prefix_ids, prefix_mask = prefix_ids.to(device), prefix_mask.to(device)
    cache_arg = models.cache_argument(model)
    positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = getattr(out, cache_arg)  # the output field has the argument's name
    index = {key: f for f, key in enumerate(distinct)}
    of_row = torch.tensor([index[key] for key in row_keys], dtype=torch.long, device=device)
    if len(distinct) < len(row_keys):  # else each row has its own, in order
        cache.batch_select_indices(of_row)
    lengths = torch.tensor([len(key) for key in row_keys], dtype=torch.long, device=device)
    positions = lengths[:, None] + torch.arange(input_ids.shape[1], device=device)[None, :]
    return model(input_ids=input_ids, attention_mask=torch.cat([prefix_mask[of_row], mask], dim=-1),
                 position_ids=positions, use_cache=True, logits_to_keep=num_logits, **{cache_arg: cache}).logits


def teacher_signals(model: Any, requests: Sequence[Request], *, source: str, model_name: str,
                    max_batch_size: int, top_k: int = 0) -> tuple[list[events.Signal], Usage]:
    """One Signal per request, from ``source`` (the teacher's name) computed by ``model`` (a
    causal LM; ``model_name`` goes on the signals), and what it computed; with ``top_k``, each
    valued token's ``top_k`` likeliest tokens too (``Signal.top_ids``). A request that
    cannot be valued gets a signal with an error and no values; a rollout whose token layer
    is inconsistent raises :class:`TokenLayerError` (check with ``join_tokens(strict=True)``
    first)."""
    config = model.config
    max_positions: int | None = getattr(config, "max_position_embeddings", None)
    vocab_size: int = model.get_input_embeddings().num_embeddings
    errors: dict[int, str] = {}
    rows: list[_Row] = []
    for index, request in enumerate(requests):
        join_tokens(request.rollout.nodes, strict=True)
        if request.error is not None:
            errors[index] = request.error
            continue
        try:
            found = _rows(index, request)
        except ValueError as exc:
            errors[index] = str(exc)
            continue
        longest = max((len(row.token_ids) for row in found), default=0)
        largest = max((max(row.token_ids, default=0) for row in found), default=0)
        if max_positions is not None and longest > max_positions:
            errors[index] = (f"rollout {request.rollout.id}: a branch of {longest} tokens is longer than teacher "
                             f"{source!r}'s context ({model_name}: max_position_embeddings = {max_positions})")
        elif largest >= vocab_size:
            errors[index] = (f"rollout {request.rollout.id}: token id {largest} is outside teacher {source!r}'s "
                             f"vocabulary ({model_name}: {vocab_size} tokens); a teacher shares the policy's tokenizer")
        else:
            rows += found
    computed = _forward(model, rows, max_batch_size, top_k) if rows else []
    values: dict[int, dict[str, list[float]]] = {}
    top_ids: dict[int, dict[str, list[list[int]]]] = {}
    top_logprobs: dict[int, dict[str, list[list[float]]]] = {}
    usage = Usage(num_tokens=sum(len(row.token_ids) for row in rows))
    for row, row_computed in zip(rows, computed, strict=True):
        node_values = values.setdefault(row.request, {})
        at = 0  # into row_computed, in the order of row.needed
        for node, start in row.starts:
            assert node.tokens is not None  # a sampled node has tokens
            mask = node.tokens.loss_mask
            taken = [j for j, sampled in enumerate(mask) if sampled and start + j > 0]
            node_values[node.id] = [0.0] * len(mask)
            ids: list[list[int]] = [[] for _ in mask]
            logprobs: list[list[float]] = [[] for _ in mask]
            for offset, j in enumerate(taken, start=at):
                node_values[node.id][j] = row_computed.values[offset]
                if top_k:
                    ids[j], logprobs[j] = row_computed.top_ids[offset], row_computed.top_logprobs[offset]
            if top_k:
                top_ids.setdefault(row.request, {})[node.id] = ids
                top_logprobs.setdefault(row.request, {})[node.id] = logprobs
            at += len(taken)
            usage.num_sampled_tokens += sum(mask)
    signals = []
    for index, request in enumerate(requests):
        r = request.rollout
        failed = index in errors
        signals.append(events.Signal(
            id=f"{r.id}.{source}", run=r.run, env=r.env, rollout_id=r.id, group_id=r.group_id, source=source,
            values={} if failed else values.get(index, {}), temperature=request.temperature,
            model=model_name, error=errors.get(index), top_ids={} if failed else top_ids.get(index, {}),
            top_logprobs={} if failed else top_logprobs.get(index, {})))
    return signals, usage


def fit_payload(signals: Sequence[events.Signal], check: Callable[[events.Signal], None]) -> list[events.Signal]:
    """``signals``, each one larger than the bus takes (``check`` raises PayloadTooLarge: the server
    would drop the connection that sent it) replaced by the same signal with an error saying so,
    and no values: its rollout is dropped as a teacher's error, never waited for."""
    out = []
    for signal in signals:
        try:
            check(signal)
        except PayloadTooLarge as exc:
            top_k = max((len(ids) for node in signal.top_ids.values() for ids in node), default=0)
            hint = f"lower the top_k of the part that reads it ({top_k} now) or " if top_k else ""
            out.append(msgspec.structs.replace(
                signal, values={}, top_ids={}, top_logprobs={},
                error=f"rollout {signal.rollout_id}: its signal is {exc.size} bytes, more than the bus takes "
                      f"({exc.limit}, nats-server's max_payload); {hint}raise max_payload"))
            continue
        out.append(signal)
    return out


# --- models and weights -------------------------------------------------------------------------


@dataclass
class Loaded:
    """A teacher model loaded in this process. ``lock`` keeps one batch or weight swap on it at a
    time (held while a batch waits for weights and is computed); ``thread_lock`` guards the
    model itself, so a forward whose batch was cancelled meanwhile still ends before the
    next one or a swap starts. ``version``: the run's weights it holds (a policy model)."""

    model: Any
    tok: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    thread_lock: threading.Lock = field(default_factory=threading.Lock)
    version: int | None = None
    error: str | None = None  # a pinned version that can never load: every signal says so
    failed: dict[int, str] = field(default_factory=dict)  # versions that did not load (following the newest)
    users: set[tuple[str, str]] = field(default_factory=set)  # (run, teacher) hosted on it


class Models:
    """Teacher models, each loaded once per process under its key and shared by the teachers
    that name it; one no teacher uses any more is dropped."""

    def __init__(self, data_dir: Path, device: str) -> None:
        self.data_dir = data_dir
        self.device = device
        self._loaded: dict[tuple[Any, ...], Loaded] = {}
        self._loading: dict[tuple[Any, ...], asyncio.Future[Loaded]] = {}

    async def get(self, key: tuple[Any, ...], name: str, dtype: str, user: tuple[str, str]) -> Loaded:
        """The model ``name`` (as ``model.name`` takes it) in ``dtype``, loaded once under ``key``."""
        loaded = self._loaded.get(key)
        if loaded is None:
            if key not in self._loading:
                self._loading[key] = asyncio.ensure_future(compute(self._load, name, dtype))
            future = self._loading[key]
            try:
                loaded = await asyncio.shield(future)
            finally:
                if future.done():
                    self._loading.pop(key, None)
            loaded = self._loaded.setdefault(key, loaded)
        loaded.users.add(user)
        return loaded

    def _load(self, name: str, dtype: str) -> Loaded:
        import torch

        from flywheel.sdk import models

        device = self.device if self.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        log.info("teachers: loading model %s (%s, %s)", name, dtype, device)
        model, tok = models.load_model(models.resolve_model(name, self.data_dir), dtype, device)
        return Loaded(model, tok)

    def release(self, run: str) -> None:
        """``run``'s teachers no longer use their models."""
        for key, loaded in list(self._loaded.items()):
            loaded.users = {u for u in loaded.users if u[0] != run}
            if not loaded.users:
                del self._loaded[key]


class RunWeights:
    """A run's weight updates by version, as a watch of ``weights.<run>`` sees them."""

    def __init__(self) -> None:
        self.updates: dict[int, events.WeightUpdate] = {}
        self._changed = asyncio.Event()

    def add(self, update: events.WeightUpdate) -> None:
        self.updates[update.version] = update
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        """Until a new update is seen, or ``timeout_s``."""
        await wait_at_most(self._changed.wait(), timeout_s)

    async def watch(self, bus: Bus, run: str, stopping: asyncio.Event) -> None:
        async for update in watch(bus, f"weights.{run}", events.WeightUpdate, stopping, watcher=WEIGHTS_WATCHER):
            self.add(update)


def _is_gone(exc: Exception) -> bool:
    """A weights fetch that fails for good: the blob is not in the bucket (purged) or does not
    verify. Anything else (the server restarting, a timeout) fails the delivery and is retried."""
    return isinstance(exc, (nats.js.errors.NotFoundError, FileNotFoundError, ValueError))


# --- one teacher of one run ---------------------------------------------------------------------


@dataclass
class Counters:
    num_signals: int = 0
    num_errors: int = 0  # signals that carry an error
    num_tokens: int = 0  # through the forward
    num_sampled_tokens: int = 0  # valued
    busy_s: float = 0.0  # computing (under the model's lock, waiting for weights not counted)

    def add(self, signals: Sequence[events.Signal], usage: Usage, busy_s: float) -> None:
        self.num_signals += len(signals)
        self.num_errors += sum(s.error is not None for s in signals)
        self.num_tokens += usage.num_tokens
        self.num_sampled_tokens += usage.num_sampled_tokens
        self.busy_s += busy_s


class Teacher:
    """One teacher of one run: the handler of its consumer's batches of rollouts."""

    def __init__(self, bus: Bus, run_config: RunConfig, name: str, environments: Mapping[str, RunEnvironment],
                 models: Models, run_weights: RunWeights | None, info: dict[str, Any]) -> None:
        """``run_weights``: the run's updates, for a teacher of model "policy"; ``info``: its entry
        in the heartbeat's info, where it keeps its counters."""
        self.bus = bus
        self.run = run_config.run
        self.name = name
        self.config: TeacherConfig = run_config.teachers[name]
        self.run_config = run_config
        self.environments = environments
        self.models = models
        self.weights = run_weights
        self.counters = Counters()
        self.info = info
        self.info.update(model=self.config.model, **vars(self.counters))

    @property
    def key(self) -> tuple[Any, ...]:
        c = self.config
        return (POLICY, self.run, c.version, c.dtype) if c.model == POLICY else (c.model, c.dtype)

    def subjects(self) -> list[str]:
        """The rollout subjects of the environments whose training reads this teacher."""
        return [f"rollouts.{self.run}.{env}.*" for env, found in self.environments.items()
                if self.name in self.run_config.teachers_of(found.config)]

    async def handle(self, deliveries: list[Delivery]) -> None:
        rollouts: list[events.Rollout] = [d.event for d in deliveries if d.event.status != "error"]
        for r in rollouts:
            try:
                join_tokens(r.nodes, strict=True)
            except TokenLayerError as exc:
                raise Reject(f"rollout {r.id}: its token layer is inconsistent: {exc}") from None
        if not rollouts:
            return
        c = self.config
        loaded = await self.models.get(self.key, self.run_config.model.name if c.model == POLICY else c.model,
                                       c.dtype, (self.run, self.name))
        async with loaded.lock:
            error = await self._prepare(loaded)
            version = loaded.version if loaded.version is not None else c.version
            model_name = f"{self.run}@v{version}" if c.model == POLICY else c.model
            started = time.monotonic()
            contexts = await self._contexts(rollouts) if error is None and c.context is not None else {}
            signals, usage = await compute(self._compute, loaded, rollouts, model_name, error, contexts)
            busy_s = time.monotonic() - started
        signals = fit_payload(signals, functools.partial(self.bus.check_fits, content_type=events.MSGPACK))
        await self.bus.publish_many(signals, events.MSGPACK, together=True)
        self.counters.add(signals, usage, busy_s)
        self.info.update(vars(self.counters))

    async def _contexts(self, rollouts: Sequence[events.Rollout]
                        ) -> dict[str, tuple[list[events.Message], list[events.Message]] | str]:
        """Each rollout's first messages without and with the teacher's context, from its
        environment's worker; or the error text its environment gave."""
        assert self.config.context is not None
        out: dict[str, tuple[list[events.Message], list[events.Message]] | str] = {}
        by_env: dict[str, list[events.Rollout]] = {}
        for r in rollouts:
            by_env.setdefault(r.env, []).append(r)
        for name, members in by_env.items():
            env = self.environments[name].env
            tasks = [r.task_data for r in members]
            try:
                plain = await env.privileged_messages(tasks, None)
                shown = await env.privileged_messages(tasks, self.config.context)
            except (WorkerError, RemoteError, EnvironmentLoadError) as exc:
                plain = shown = [f"{type(exc).__name__}: {exc}"] * len(members)
            for r, student, teacher in zip(members, plain, shown, strict=True):
                failed = next((m for m in (student, teacher) if isinstance(m, str)), None)
                out[r.id] = (f"teacher {self.name!r}: the context of rollout {r.id} failed in environment "
                             f"{env.name!r}: {failed}") if failed is not None else (student, teacher)  # type: ignore[assignment]  # both lists here
        return out

    def _compute(self, loaded: Loaded, rollouts: Sequence[events.Rollout], model_name: str, error: str | None,
                 contexts: Mapping[str, tuple[list[events.Message], list[events.Message]] | str]
                 ) -> tuple[list[events.Signal], Usage]:
        """(On the compute thread.) The rollouts' signals; each says ``error`` when it is set."""
        requests = [self._request(loaded.tok, r, error, contexts.get(r.id)) for r in rollouts]
        with loaded.thread_lock:
            return teacher_signals(loaded.model, requests, source=self.name, model_name=model_name,
                                   max_batch_size=self.config.max_batch_size,
                                   top_k=self.run_config.top_k_of(self.name))

    def _request(self, tok: Any, rollout: events.Rollout, error: str | None,
                 context: tuple[list[events.Message], list[events.Message]] | str | None) -> Request:
        temperature = (rollout.sampling or self.run_config.sampling).temperature
        if error is not None or self.config.context is None:
            return Request(rollout, temperature, error=error)
        if context is None or isinstance(context, str):
            return Request(rollout, temperature, error=context or f"teacher {self.name!r}: no context of rollout "
                           f"{rollout.id}")
        return Request(rollout, temperature, context_of(tok, *context))

    async def _prepare(self, loaded: Loaded) -> str | None:
        """Give a policy teacher's model the weights it computes with (under ``loaded.lock``):
        the pinned version, loaded once, or the newest seen. Returns the error every signal
        of the batch gets instead (a version that can never load); waits, saying so every
        WAIT_LOG_S, for a version not published yet."""
        if self.config.model != POLICY:
            return None
        assert self.weights is not None  # a policy teacher's run has its updates watched
        pinned = self.config.version
        began, logged = time.monotonic(), -WAIT_LOG_S
        while True:
            if pinned is not None:
                if loaded.version == pinned or loaded.error is not None:
                    return loaded.error
                update = self.weights.updates.get(pinned)
                newer = [v for v in self.weights.updates if v > pinned]
                if update is not None:
                    await self._load(loaded, update, pinned=True)
                    continue
                if newer:
                    loaded.error = (f"teacher {self.name!r}: weights version {pinned} of run {self.run!r} is not "
                                    "among its weight updates on the bus (they go from version "
                                    f"{min(self.weights.updates)} to {max(self.weights.updates)})")
                    continue
                what = f"weights version {pinned} of run {self.run!r}, not published yet"
            else:
                candidates = sorted((v for v in self.weights.updates
                                     if v > (loaded.version if loaded.version is not None else -1)
                                     and v not in loaded.failed), reverse=True)
                for version in candidates:
                    if await self._load(loaded, self.weights.updates[version], pinned=False):
                        break
                if loaded.version is not None:
                    return None
                what = f"the first weights of run {self.run!r} (version 0, published once its trainer starts)"
            now = time.monotonic()
            if now - logged >= WAIT_LOG_S:
                log.info("teacher %s of run %s waits for %s (%.0f s so far)", self.name, self.run, what, now - began)
                logged = now
            await self.weights.changed(WAIT_LOG_S)

    async def _load(self, loaded: Loaded, update: events.WeightUpdate, pinned: bool) -> bool:
        """Load ``update``'s weights into ``loaded``; False (recorded, logged) when its blob is gone or
        does not verify."""
        from flywheel.sdk import models

        try:
            data = await weights.get(self.bus, update)
        except Exception as exc:
            if not _is_gone(exc):
                raise
            why = ("it is no longer in the run's weights bucket (the trainer keeps its newest few: its setting "
                   "weight_versions_kept)" if not isinstance(exc, ValueError) else "its blob does not verify")
            reason = (f"teacher {self.name!r}: weights version {update.version} of run {self.run!r} cannot be "
                      f"loaded: {why} ({type(exc).__name__}: {exc})")
            log.warning("%s", reason)
            if pinned:
                loaded.error = reason
            else:
                loaded.failed[update.version] = reason
            return False

        def swap() -> None:
            with loaded.thread_lock:
                models.load_weights(loaded.model, data)

        await compute(swap)
        loaded.version = update.version
        log.info("teacher %s of run %s: weights version %d loaded", self.name, self.run, update.version)
        return True


# --- the host -----------------------------------------------------------------------------------


@dataclass
class HostedTeachers:
    """One run's teachers as hosted here: their consumers and what runs them."""

    teachers: list[Teacher]
    consumers: list[Consumer]
    running: list[asyncio.Future[None]]
    stopping: asyncio.Event  # stops its weights watcher


class TeacherHost:
    """Hosts every run's teachers in this process (see the module docstring): a task of the
    inference Service (:meth:`run`)."""

    def __init__(self, bus: Bus, data_dir: Path, settings: InferenceSettings, info: dict[str, Any],
                 pool: WorkerPool, trusted_modules: Sequence[str] = ()) -> None:
        """``settings``: the settings' ``inference`` section; ``info``: the heartbeat's, where
        ``info["teachers"]`` gets each run's teachers' counters; ``pool``: the environment workers
        that give the first messages teachers see; ``trusted_modules``: the setting, where a run
        config's parts by path may come from."""
        self.bus = bus
        self.trusted_modules = trusted_modules
        self.pool = pool
        self.settings = settings
        self.info = info
        self.info.setdefault("teachers", {})
        self.models = Models(data_dir, settings.teacher_device)
        self._states: dict[str, events.RunState] = {}
        self._hosted: dict[str, HostedTeachers] = {}
        self._refused: dict[str, str] = {}  # runs not hosted, why (logged once per reason)
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()

    def runs(self) -> list[str]:
        """The runs whose teachers are hosted now."""
        return list(self._hosted)

    async def run(self, stopping: asyncio.Event) -> None:
        """Host the teachers of the runs that go on, until ``stopping``; raises what a teacher's
        consumer or the run-state watcher died of."""
        watching = asyncio.ensure_future(watch_runs(self.bus, stopping, self._on_state))
        watching.add_done_callback(lambda _: self._wake.set())
        outcome: BaseException | None = None
        try:
            while not stopping.is_set() and not watching.done() and self._failure is None:
                self._wake.clear()
                waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(self._wake.wait())]
                await asyncio.wait(waits, timeout=CHECK_S, return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                for run in list(self._hosted):  # a dead owner writes nothing: its lease expires unannounced
                    await self._check(run)
        finally:
            watching.cancel()  # first: it would host runs again
            (outcome,) = await asyncio.gather(watching, return_exceptions=True)
            for run in list(self._hosted):
                await self._unhost(run, "the inference process stops")
        if self._failure is not None:
            raise self._failure
        if isinstance(outcome, Exception):  # the watcher died (cancelled by this: not an error)
            raise outcome

    async def _on_state(self, state: events.RunState) -> None:
        self._states[state.id] = state
        await self._check(state.id)

    async def _check(self, run: str) -> None:
        state = self._states[run]
        end = end_of(state)
        if run in self._hosted:
            if end is not None:
                await self._unhost(run, end.reason)
            return
        if end is not None or not state.config or state.kind != "train":  # an eval run has no teachers
            return
        try:
            cfg = RunConfig.parse(state.config, source=f"run {run!r} config", trusted_modules=self.trusted_modules)
            if not cfg.teachers:
                return
            environments = await load_run_environments(self.pool, cfg, state.tenant)
        except Exception as exc:  # a config or an environment that does not load here: said, and tried again
            reason = f"{type(exc).__name__}: {exc}"
            if self._refused.get(run) != reason:
                log.error("run %s: its teachers are not hosted here: %s", run, reason)
            self._refused[run] = reason
            return
        self._refused.pop(run, None)
        await self._host(cfg, environments)

    async def _host(self, cfg: RunConfig, environments: Mapping[str, RunEnvironment]) -> None:
        run, s = cfg.run, self.settings
        stopping = asyncio.Event()
        run_weights: RunWeights | None = None
        running: list[asyncio.Future[None]] = []
        if any(t.model == POLICY for t in cfg.teachers.values()):
            run_weights = RunWeights()
            running.append(asyncio.ensure_future(run_weights.watch(self.bus, run, stopping)))
        counters: dict[str, Any] = self.info["teachers"].setdefault(run, {})
        teachers, consumers = [], []
        for name in cfg.teachers:
            teacher = Teacher(self.bus, cfg, name, environments, self.models, run_weights,
                              counters.setdefault(name, {}))
            subjects = teacher.subjects()
            if not subjects:
                continue
            teachers.append(teacher)
            consumers.append(Consumer(
                self.bus, stream="ROLLOUTS", durable=teacher_durable(run, name), filter_subject=subjects,
                batch_handler=teacher.handle, event_type=events.Rollout, max_in_flight=s.teacher_max_in_flight,
                batch_size=s.teacher_batch_size, max_deliver=s.max_deliver, backoff_s=s.backoff_s,
                ack_wait_s=s.ack_wait_s, grace_s=s.grace_s, inactive_threshold_s=DURABLE_INACTIVE_S,
                recreate_if=functools.partial(self._goes_on, run)))  # deleted at the run's end: not made again
        running += [asyncio.ensure_future(consumer.run()) for consumer in consumers]
        for future in running:
            future.add_done_callback(functools.partial(self._ended, run))
        self._hosted[run] = HostedTeachers(teachers, consumers, running, stopping)
        log.info("run %s: hosting teachers %s", run, ", ".join(f"{t.name} ({t.config.model})" for t in teachers))

    def _goes_on(self, run: str) -> bool:
        """Whether ``run`` has not ended, as this host last read its state."""
        state = self._states.get(run)
        return state is None or state.status not in ENDED_STATUSES

    def _ended(self, run: str, future: asyncio.Future[None]) -> None:
        """A consumer or weights watcher of ``run`` returned: an error stops the host."""
        if future.cancelled() or future.exception() is None:
            return
        log.error("run %s: a teacher's consumer failed", run, exc_info=future.exception())
        self._failure = self._failure or future.exception()
        self._wake.set()

    async def _unhost(self, run: str, reason: str) -> None:
        """Stop ``run``'s teachers: their consumers finish or hand back what they hold."""
        hosted = self._hosted.pop(run, None)
        if hosted is None:  # stopped meanwhile, by the state watcher or the lease check
            return
        log.info("run %s: its teachers stop: %s", run, reason)
        hosted.stopping.set()
        for consumer in hosted.consumers:
            consumer.stop()
        await asyncio.gather(*hosted.running, return_exceptions=True)
        self.models.release(run)
        state = self._states.get(run)
        if state is not None and state.status in ENDED_STATUSES:  # nothing more to value: its durables go
            durables = [("ROLLOUTS", teacher_durable(run, t.name)) for t in hosted.teachers]
            await let_run_durables_go(self.bus, run, durables, "its teachers'")
