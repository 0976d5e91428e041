"""From token sequences to tensors, and the logprobs the trainer recomputes on them.

Each rollout is one sequence (its token spans concatenated, see
:func:`flywheel_trainer.join.tokens_of`). A micro-batch pads its sequences on the right
and masks the padding out of attention, so every real position sees exactly the tokens
before it, as during sampling. Targets are shifted by one: position ``t`` of the
logits predicts token ``t + 1``, so the loss mask, the sampled logprobs and the
recomputed logprobs are all ``[batch, length - 1]`` and line up with the *target* token.

:func:`token_logprobs` computes what inference records for a sampled token,
``log_softmax(logits / temperature)`` in float32, each sequence at the temperature it was
sampled with (a task may set its own), so under the same weights the ratio is 1 up to
float rounding (tests hold the difference under 1e-3).

:func:`micro_batches` keeps the sequences of one prompt together (a group's samples,
the branches of one rollout), families longest first, so sequences of like length share
a micro-batch and little compute goes to padding. Within a micro-batch, :func:`pad` puts
what several rows share (the prompt but its last token) in a :class:`Prefix`: it is run
once, and each row goes on from its keys and values, so a group of 16 samples of one
prompt computes that prompt once instead of 16 times, forward and backward. The logprobs
are the same as on whole rows (tests hold them and the gradients to float rounding).

:func:`pack` lays a micro-batch out with no padding between sequences (``trainer.pack``):
the sequences of one prompt in one packed row, prompts sharing rows up to
:data:`PACK_ROW_TOKENS`, each row a token trie, so every beginning its sequences share (a
group's prompt, a system prompt all prompts start with, the history a rollout's branches
share) is computed once, each token at the position it has in its own sequence, under a tree
mask (a token sees the tokens before it on its own path). No key/value cache is needed (so it
composes with activation checkpointing); attention covers each packed row whole, the masked
part included, which is why rows are bounded.

:func:`loss_logprobs` computes the same logprobs at the loss's positions alone: the output
embedding and the softmax over the vocabulary (for a model of SmolLM2's size, a third of a
step's memory) skip the padding and the tokens no loss reads. It needs a model whose logits
are its head applied to its body (:func:`split_head`); others run whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flywheel.sdk import models
from flywheel_trainer.join import Tokens, TopK


@dataclass
class Prefix:
    """Context several rows of a micro-batch share (a group's prompt), run once for all of them.

    The distinct prefixes are left-padded, so each ends where its rows go on; each row's
    keys and values for its prefix are that prefix's, indexed (the gradient from every row
    sums into the one forward)."""

    input_ids: torch.Tensor  # [F, P] long, left-padded
    attention_mask: torch.Tensor  # [F, P] long, 1 on real tokens
    of_row: torch.Tensor  # [B] long: the prefix each row goes on from
    lengths: torch.Tensor  # [B] long: that prefix's real tokens (the row's first position)


@dataclass(frozen=True)
class DenseRow:
    """One sequence's dense distillation target: the teacher's top-k at its positions, the term's
    weight, and which KL (see :func:`flywheel_trainer.losses.top_k_divergence`)."""

    top: TopK
    coef: float
    forward: bool


@dataclass
class DenseTargets:
    """The dense term's targets at the ``N`` target positions that have one (a row's sampled
    tokens), gathered: where they are and what the teacher gave."""

    rows: torch.Tensor  # [N] long: the batch row
    columns: torch.Tensor  # [N] long: the target position (a column of the [B, T-1] tensors)
    top_ids: torch.Tensor  # [N, K] long
    top_logprobs: torch.Tensor  # [N, K] float32
    valid: torch.Tensor  # [N, K] bool: real entries (a row may give fewer than K)
    coef: torch.Tensor  # [N] float32: its row's term weight
    forward: torch.Tensor  # [N] bool: its row's KL direction


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded (after the prefix, when there is one)
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T-1] bool, by target token
    old_logprobs: torch.Tensor  # [B, T-1] float32, by target token (what inference sampled with)
    advantages: torch.Tensor  # [B] float32
    temperatures: torch.Tensor  # [B] float32, what each sequence was sampled at
    prefix: Prefix | None = None  # what the rows share, computed once; None: each row is whole
    env_mask: torch.Tensor | None = None  # [B, T-1] bool, by target token: the environment's (echo); None: none
    echo_weights: torch.Tensor | None = None  # [B] float32: each row's echo weight, with env_mask
    # [B, T-1] float32, by target token: a per-token part added to each row's advantage (a
    # teacher's term: on-policy distillation, KL); None: none
    token_advantages: torch.Tensor | None = None
    dense: DenseTargets | None = None  # a teacher's top-k at the sampled positions; None: no dense term

    def advantages_by_token(self) -> torch.Tensor:
        """Each target token's advantage: ``[B, 1]`` (the row's) or ``[B, T-1]`` (with a per-token part)."""
        row = self.advantages[:, None]
        return row if self.token_advantages is None else row + self.token_advantages

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Real tokens the batch computes (a shared prefix once)."""
        shared = 0 if self.prefix is None else int(self.prefix.attention_mask.sum())
        return int(self.attention_mask.sum()) + shared


def prefix_length(s: Tokens) -> int:
    """How many leading tokens of ``s`` can be shared with sequences that begin the same way:
    all before its first trained target's context (the prompt but its last token, whose
    logits predict the first sampled token). 0 when nothing is trained."""
    for i, trained in enumerate(s.loss_mask):
        if trained:
            return max(i - 1, 0)
    return 0


def _prefix_key(s: Tokens) -> tuple[int, ...]:
    return tuple(s.token_ids[:prefix_length(s)])


def pad(sequences: list[Tokens], advantages: list[float], pad_id: int, device: torch.device | str = "cpu",
        temperatures: list[float] | None = None, share_prefixes: bool = True,
        echo_weights: list[float] | None = None, token_advantages: list[list[float]] | None = None,
        dense: list[DenseRow | None] | None = None) -> Batch:
    """Right-pad ``sequences`` into one :class:`Batch` on ``device``; ``temperatures``: what each
    was sampled at (None: 1.0 each, as for reference answers). When some of them begin with
    the same prompt (``share_prefixes``), that prompt becomes a :class:`Prefix`, computed once,
    and the rows hold the rest. ``echo_weights``: each sequence's echo weight; where one is
    above 0 its environment tokens go into ``env_mask`` (None or all 0: no ``env_mask``).
    ``token_advantages``: each sequence's per-token part of its advantage, aligned with its
    tokens (None: none). ``dense``: each sequence's dense distillation target, or None (None
    or all None: no dense term)."""
    temperatures = temperatures if temperatures is not None else [1.0] * len(sequences)
    echo = echo_weights is not None and any(w > 0 for w in echo_weights)
    assert sequences and len(sequences) == len(advantages) == len(temperatures)
    keys = [_prefix_key(s) for s in sequences] if share_prefixes else []
    distinct = list(dict.fromkeys(keys))
    prefix: Prefix | None = None
    starts = [0] * len(sequences)
    if share_prefixes and len(distinct) < len(sequences) and any(distinct):
        index = {key: i for i, key in enumerate(distinct)}
        width = max(len(key) for key in distinct)
        prefix_ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
        prefix_mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for i, key in enumerate(distinct):
            if key:
                prefix_ids[i, width - len(key):] = torch.tensor(key, dtype=torch.long)
                prefix_mask[i, width - len(key):] = 1
        starts = [len(key) for key in keys]
        prefix = Prefix(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device),
                        of_row=torch.tensor([index[key] for key in keys], dtype=torch.long, device=device),
                        lengths=torch.tensor(starts, dtype=torch.long, device=device))
    length = max(len(s.token_ids) - start for s, start in zip(sequences, starts, strict=True))
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.bool)
    old_logprobs = torch.zeros((rows, length), dtype=torch.float32)
    env_mask = torch.zeros((rows, length), dtype=torch.bool)
    by_token = torch.zeros((rows, length), dtype=torch.float32) if token_advantages is not None else None
    for i, (s, start) in enumerate(zip(sequences, starts, strict=True)):
        n = len(s.token_ids) - start
        input_ids[i, :n] = torch.tensor(s.token_ids[start:], dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.loss_mask[start:], dtype=torch.bool)
        old_logprobs[i, :n] = torch.tensor(s.logprobs[start:], dtype=torch.float32)
        if by_token is not None and token_advantages is not None:
            assert len(token_advantages[i]) == len(s.token_ids), "a per-token advantage for each token"
            by_token[i, :n] = torch.tensor(token_advantages[i][start:], dtype=torch.float32)
        if echo and echo_weights is not None and echo_weights[i] > 0 and s.env_mask:
            # A shared prefix ends before the first sampled token, so it holds no environment token.
            assert not any(s.env_mask[:start]), "an environment token in a shared prefix"
            env_mask[i, :n] = torch.tensor(s.env_mask[start:], dtype=torch.bool)
    return Batch(
        dense=_dense_targets(sequences, starts, dense, device) if dense is not None and any(dense) else None,
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        loss_mask=loss_mask[:, 1:].to(device),
        old_logprobs=old_logprobs[:, 1:].to(device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
        prefix=prefix,
        env_mask=env_mask[:, 1:].to(device) if echo else None,
        echo_weights=torch.tensor(echo_weights, dtype=torch.float32, device=device)
        if echo and echo_weights is not None else None,
        token_advantages=by_token[:, 1:].to(device) if by_token is not None else None,
    )


def _dense_targets(sequences: list[Tokens], starts: list[int], dense: list[DenseRow | None],
                   device: torch.device | str) -> DenseTargets:
    """The gathered dense targets of the rows (each row's tokens from ``starts``: after a shared
    prefix, which holds no sampled token); a token's top-k predicts it, so it sits at target
    column ``position - 1``."""
    rows, columns, ids, logprobs, coef, forward = [], [], [], [], [], []
    for i, (s, start, target) in enumerate(zip(sequences, starts, dense, strict=True)):
        if target is None:
            continue
        assert len(target.top.ids) == len(s.token_ids), "a top-k list for each token"
        for position in range(start + 1, len(s.token_ids)):
            if s.loss_mask[position] and target.top.ids[position]:
                rows.append(i)
                columns.append(position - start - 1)
                ids.append(target.top.ids[position])
                logprobs.append(target.top.logprobs[position])
                coef.append(target.coef)
                forward.append(target.forward)
    k = max((len(x) for x in ids), default=1)
    top_ids = torch.zeros((len(ids), k), dtype=torch.long)
    top_logprobs = torch.zeros((len(ids), k), dtype=torch.float32)
    valid = torch.zeros((len(ids), k), dtype=torch.bool)
    for n, (x, y) in enumerate(zip(ids, logprobs, strict=True)):
        top_ids[n, :len(x)] = torch.tensor(x, dtype=torch.long)
        top_logprobs[n, :len(y)] = torch.tensor(y, dtype=torch.float32)
        valid[n, :len(x)] = True
    return DenseTargets(rows=torch.tensor(rows, dtype=torch.long, device=device),
                        columns=torch.tensor(columns, dtype=torch.long, device=device),
                        top_ids=top_ids.to(device), top_logprobs=top_logprobs.to(device), valid=valid.to(device),
                        coef=torch.tensor(coef, dtype=torch.float32, device=device),
                        forward=torch.tensor(forward, dtype=torch.bool, device=device))


def micro_batches(sequences: list[Tokens], size: int, max_tokens: int | None = None,
                  min_passes: int = 1) -> list[list[int]]:
    """Indices of ``sequences`` in micro-batches of at most ``size`` sequences and, given
    ``max_tokens``, at most that many padded tokens (rows times the longest; one sequence
    longer than that is a micro-batch of its own): sequences that begin with the same prompt
    side by side (so a micro-batch computes that prompt once), longest first. ``min_passes``:
    at least that many micro-batches when there are that many sequences (one for each rank)."""
    families: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i].token_ids)):
        families.setdefault(_prefix_key(sequences[i]), []).append(i)
    order = [i for family in families.values() for i in family]  # families by their longest member
    size = max(1, min(size, -(-len(order) // max(min_passes, 1))))
    cut: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = len(sequences[i].token_ids)
        if current and (len(current) == size or (max_tokens is not None
                                                  and max(longest, n) * (len(current) + 1) > max_tokens)):
            cut.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    return cut + [current] if current else cut


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each target token, float32, ``[B, T-1]``, each
    row at its own sequence's temperature."""
    return target_logprobs(batch_logits(model, batch), batch, batch.temperatures)


def batch_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The logits that predict each target token, ``[B, T-1, V]``."""
    if batch.prefix is None:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return _logits_after_prefix(model, batch, batch.prefix)


def target_logprobs(logits: torch.Tensor, batch: Batch, temperatures: torch.Tensor | None) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each target token, float32, ``[B, T-1]``, by row
    (``temperatures`` ``[B]``; None: the model's own distribution, temperature 1)."""
    scaled = logits.float() if temperatures is None else logits.float() / temperatures[:, None, None]
    return torch.log_softmax(scaled, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


# Causal LMs whose logits are exactly their output embedding applied to their body's last
# hidden states (no logit scaling or soft-capping after it): their logits can be computed at
# the positions the loss reads alone.
HEAD_AFTER_BODY = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``model``'s body (its hidden states after the final norm) and head (the output
    embedding), when its logits are exactly ``head(body(...))``; None otherwise (then the
    whole forward runs)."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if not isinstance(model, PreTrainedModel) or not isinstance(body, PreTrainedModel):
        return None  # wrapped (a LoRA model: its head and body are the adapter's), or of the user's own
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if getattr(config, "model_type", None) not in HEAD_AFTER_BODY or body is None or type(head) is not torch.nn.Linear:
        return None
    return body, head


def loss_logprobs(model: torch.nn.Module, batch: Batch, module: torch.nn.Module | None = None) -> torch.Tensor:
    """What :func:`token_logprobs` gives, computed at the loss's positions alone (0 elsewhere):
    the output embedding and the softmax over the vocabulary, the largest tensors of a step,
    skip the padding and every token the loss does not read. ``[B, T-1]`` float32. ``module``:
    the model ``model`` runs, when ``model`` wraps it (DeepSpeed's engine). A model whose head
    is not a plain projection of its body runs whole (:func:`split_head`)."""
    parts = split_head(model if module is None else module)
    if parts is None:
        return token_logprobs(model, batch)
    body, head = parts
    if batch.prefix is None:
        hidden = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    else:
        hidden = _hidden_after_prefix(model, body, batch, batch.prefix)
    rows, columns = batch.loss_mask.nonzero(as_tuple=True)
    logits = head(hidden[rows, columns]).float() / batch.temperatures[rows, None]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[rows, columns + 1, None]).squeeze(-1)
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=picked.device)
    return out.index_put((rows, columns), picked)


def can_share_prefixes(model: torch.nn.Module) -> bool:
    """Whether ``model`` can go on from a computed prefix: its forward takes explicit
    positions, a key/value cache and ``logits_to_keep`` (every transformers causal LM does;
    a model of the user's own may not, and is then run on whole rows)."""
    params = models.forward_params(model)
    return {"position_ids", "use_cache", "logits_to_keep"} <= params.keys() and (
        "cache" in params or "past_key_values" in params)


def _prefix_cache(model: torch.nn.Module, batch: Batch, prefix: Prefix) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The prefixes run once, their keys and values given to each row; with the rows'
    positions and attention mask (prefix and row)."""
    cache_arg = models.cache_argument(model)
    prefix_positions = (prefix.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prefix.input_ids, attention_mask=prefix.attention_mask, position_ids=prefix_positions,
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, cache_arg)  # the output field has the argument's name
    cache.batch_select_indices(prefix.of_row)  # each row gets its prefix's; the gradient sums back
    width = batch.input_ids.shape[1]
    positions = prefix.lengths[:, None] + torch.arange(width, device=batch.input_ids.device)[None, :]
    mask = torch.cat([prefix.attention_mask[prefix.of_row], batch.attention_mask], dim=-1)
    return cache, positions, mask


def _logits_after_prefix(model: torch.nn.Module, batch: Batch, prefix: Prefix) -> torch.Tensor:
    """The rows' logits (but the last position's), each row going on from its prefix's keys and values."""
    cache, positions, mask = _prefix_cache(model, batch, prefix)
    out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=batch.input_ids.shape[1], **{models.cache_argument(model): cache})
    return out.logits[:, :-1]


def _hidden_after_prefix(model: torch.nn.Module, body: torch.nn.Module, batch: Batch, prefix: Prefix
                         ) -> torch.Tensor:
    """The rows' last hidden states, each row going on from its prefix's keys and values."""
    cache, positions, mask = _prefix_cache(model, batch, prefix)
    out = body(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
               **{models.cache_argument(body): cache})
    return out.last_hidden_state


# A packed row's tokens at most, unless one sequence alone is longer: attention covers a row
# whole (what its mask hides included), which grows as its square, so sequences that share
# nothing past this go to rows of their own (one row of SmolLM2's 1,224 benchmark tokens
# took 1.3 times as long as two of about 600).
PACK_ROW_TOKENS = 1024
MAX_PACKED_TOKENS = 4096  # a packed row's tokens at most (its mask is this squared); past it, padded


@dataclass
class Packed:
    """A micro-batch's tokens in rows without padding between sequences: the sequences (a
    shared prefix and the row after it) laid in a token trie per row, so whatever rows of one
    packed row begin with alike (a group's prompt, a system prompt every prompt starts with, the
    history a rollout's branches share, two equal completions) is computed once. A token
    attends to itself and to the tokens before it on its own path (a tree mask), at the
    position it has in its sequence, so each sequence computes exactly what it computes alone.
    The sequences of one prompt stay in one packed row; prompts go to rows first-fit, largest
    first, a new row when none has room under :data:`PACK_ROW_TOKENS`."""

    input_ids: torch.Tensor  # [K, L] long (the rows right-padded to the longest)
    position_ids: torch.Tensor  # [K, L] long
    mask: torch.Tensor  # [K, 1, L, L] bool: True where a query may attend (padding: itself alone)
    at: torch.Tensor  # [B, T] long: each batch position's place in the flattened [K * L] (where attention_mask)


class _Trie:
    """One packed row's tokens: node i + 1 is token i (node 0, the root, holds none); a node
    comes after its parent."""

    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.parent, self.token, self.depth = [-1], [-1], [-1]

    def __len__(self) -> int:
        return len(self.parent) - 1

    @classmethod
    def copy_of(cls, trie: _Trie) -> _Trie:
        out = cls()
        out.children = [dict(c) for c in trie.children]
        out.parent, out.token, out.depth = list(trie.parent), list(trie.token), list(trie.depth)
        return out

    def add_all(self, sequences: list[list[int]]) -> int:
        """Lay every one of ``sequences`` in; how many tokens they added."""
        before = len(self)
        for ids in sequences:
            self.add(ids)
        return len(self) - before

    def add(self, ids: list[int]) -> list[int]:
        """Lay ``ids`` in; the token index of each."""
        node, places = 0, []
        for t in ids:
            child = self.children[node].get(t)
            if child is None:
                child = self.children[node][t] = len(self.parent)
                self.children.append({})
                self.parent.append(node)
                self.token.append(t)
                self.depth.append(self.depth[node] + 1)
            node = child
            places.append(node - 1)
        return places

    def sees(self) -> torch.Tensor:
        """[n, n] bool: a token sees what its parent sees, and itself."""
        n = len(self)
        out = torch.zeros((n, n), dtype=torch.bool)
        for i in range(n):
            if self.parent[i + 1] > 0:
                out[i] = out[self.parent[i + 1] - 1]
            out[i, i] = True
        return out


def pack(batch: Batch, row_tokens: int | None = None) -> Packed | None:
    """The tokens of ``batch`` (its prefixes included) as packed rows of ``row_tokens`` at most
    (default :data:`PACK_ROW_TOKENS`; see :class:`Packed`); None when a row would hold more
    than :data:`MAX_PACKED_TOKENS` (one prompt's sequences are never split)."""
    row_tokens = PACK_ROW_TOKENS if row_tokens is None else row_tokens
    device = batch.input_ids.device
    rows, width = batch.input_ids.shape
    lengths = batch.attention_mask.sum(-1).tolist()
    heads: list[list[int]] = [[] for _ in range(rows)]
    if batch.prefix is not None:
        p = batch.prefix
        real = [p.input_ids[f][p.attention_mask[f].bool()].tolist() for f in range(p.input_ids.shape[0])]
        heads = [real[int(f)] for f in p.of_row.tolist()]
    sequences = [heads[b] + batch.input_ids[b, :lengths[b]].tolist() for b in range(rows)]
    # Families (the sequences of one prompt: up to a row's first trained token) stay whole; they
    # go to rows first-fit, largest first, each row one trie (what families share, once).
    families: dict[tuple[int, ...], list[int]] = {}
    for b, ids in enumerate(sequences):
        trained = batch.loss_mask[b].nonzero()
        first = len(heads[b]) + (int(trained[0]) if len(trained) else lengths[b])
        families.setdefault(tuple(ids[:first + 1]), []).append(b)
    sizes = {key: _Trie().add_all([sequences[b] for b in members]) for key, members in families.items()}
    tries: list[_Trie] = []
    placed: dict[int, tuple[int, list[int]]] = {}  # batch row: its packed row, its tokens' places there
    for key in sorted(families, key=lambda k: -sizes[k]):
        members = families[key]
        k = next((k for k, trie in enumerate(tries)
                  if len(trie) + _Trie.copy_of(trie).add_all([sequences[b] for b in members]) <= row_tokens), None)
        if k is None:
            k = len(tries)
            tries.append(_Trie())
        for b in members:
            placed[b] = (k, tries[k].add(sequences[b])[len(heads[b]):])
    length = max(len(trie) for trie in tries)
    if length > MAX_PACKED_TOKENS:  # one prompt's sequences alone (a large group of long ones)
        return None
    input_ids = torch.zeros((len(tries), length), dtype=torch.long)
    position_ids = torch.zeros((len(tries), length), dtype=torch.long)
    mask = torch.eye(length, dtype=torch.bool).repeat(len(tries), 1, 1)  # padding sees itself: no empty softmax
    for k, trie in enumerate(tries):
        n = len(trie)
        input_ids[k, :n] = torch.tensor(trie.token[1:], dtype=torch.long)
        position_ids[k, :n] = torch.tensor(trie.depth[1:], dtype=torch.long)
        mask[k, :n, :n] = trie.sees()
    at = torch.zeros((rows, width), dtype=torch.long)
    for b, (k, places) in placed.items():
        at[b, :len(places)] = k * length + torch.tensor(places, dtype=torch.long)
    return Packed(input_ids=input_ids.to(device), position_ids=position_ids.to(device), mask=mask[:, None].to(device),
                  at=at.to(device))


def packed_loss_logprobs(model: torch.nn.Module, batch: Batch, module: torch.nn.Module | None = None
                         ) -> torch.Tensor:
    """:func:`loss_logprobs` with the body run on the micro-batch packed (:func:`pack`): no
    compute on padding, every shared beginning once, at the cost of attention over the packed
    row (its masked-out part included). A model whose head is not a plain projection of its
    body runs whole, padded (:func:`split_head`); a micro-batch whose packed row would pass
    :data:`MAX_PACKED_TOKENS`, padded (:func:`loss_logprobs`)."""
    parts = split_head(model if module is None else module)
    if parts is None:
        return token_logprobs(model, batch)
    packed = pack(batch)
    if packed is None:
        return loss_logprobs(model, batch, module)
    body, head = parts
    hidden = body(input_ids=packed.input_ids, attention_mask=packed.mask,
                  position_ids=packed.position_ids).last_hidden_state
    rows, columns = batch.loss_mask.nonzero(as_tuple=True)
    picked_hidden = hidden.reshape(-1, hidden.shape[-1])[packed.at[rows, columns]]
    logits = head(picked_hidden).float() / batch.temperatures[rows, None]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[rows, columns + 1, None]).squeeze(-1)
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=picked.device)
    return out.index_put((rows, columns), picked)
