"""The learner: one optimizer step from whole groups, and the supervised warm-up.

:func:`rl_step` turns the groups a step took into sequences with advantages (the run's
``trainer.advantage``), recomputes each target token's logprob at the sampling
temperature, applies the run's ``trainer.loss`` against the logprobs inference sampled
with, and steps the engine once. :func:`sft_warmup` trains on the environment's reference
answers with cross-entropy on the completion tokens only, before RL and before version 0
is published, so inference and trainer start from the same weights.

Both go through :func:`train_step`: micro-batches of at most ``micro_batch_size`` sequences
and ``micro_batch_tokens`` padded tokens (the settings ``trainer.micro_batch_size`` and
``trainer.micro_batch_tokens``), one backward each, the loss normalised by the number
of loss tokens in the whole step (not per micro-batch), so the gradient does not depend on
how the step was cut. Runs in a worker thread of the service: nothing here touches the
event loop.

In a run with several environments each group takes its environment's advantage and each
sequence its loss (``[[envs]]`` ``advantage``, ``loss``; unset: the run's), within one
step; :func:`sft_warmup` mixes the environments' reference answers by their weights.

With an echo weight (``trainer.echo``, or an environment's ``echo``) the step adds the mean
cross-entropy on the environment's tokens (tool results, user turns after the model's first
answer: :func:`flywheel_trainer.join.environment_mask`), times that weight, to the RL loss on
the sampled tokens: the model learns what its environment answers while RL shapes what it
does, in one backward.

With teachers (``[teachers.<name>]``), an environment's advantage may have a per-token part:
on-policy distillation (``advantage = {type = "opd", teacher = ...}``) and a KL term
(``trainer.kl``) each add ``coef`` x (the teacher's logprob - the sampled logprob) to every
sampled token's advantage, from the teacher's signal the join brought, centered on its mean
over the step's sampled tokens of the environment (as tinker-cookbook's distillation does: the
raw gap is mostly negative and would push every sampled token down); ``teacher.<name>.kl``
is the mean of (sampled - teacher) logprob over those tokens, the per-token estimate of the
reverse KL the term drives down.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.contract import events
from flywheel.contract.config import EnvConfig, LossPart, RunConfig, SFTTerm
from flywheel.runtime.environments import WorkerEnvironment
from flywheel.sdk import models
from flywheel_trainer.advantages import ADVANTAGES
from flywheel_trainer.batch import (
    Batch,
    DenseRow,
    DenseTargets,
    batch_logits,
    can_share_prefixes,
    loss_logprobs,
    micro_batches,
    packed_loss_logprobs,
    pad,
    target_logprobs,
)
from flywheel_trainer.chats import batches, load_dataset_examples, load_examples, sft_examples
from flywheel_trainer.engines import Engine, TorchEngine
from flywheel_trainer.join import Scored, Tokens, TopK, signal_top, signal_values
from flywheel_trainer.losses import LOSSES, top_k_divergence
from flywheel_trainer.ranks import current_ranks, sum_over_ranks

log = logging.getLogger(__name__)
LOSS_FIGURES = ("loss", "echo_loss", "sft_term_loss", "distill_loss")  # summed over micro-batches (and ranks)

# (recomputed logprobs, batch, the batch's sequences by index in the step) -> (per-token
# loss, per-token flag: clipped or masked)
TokenLoss = Callable[[torch.Tensor, Batch, list[int]], tuple[torch.Tensor, torch.Tensor]]


def train_step(engine: Engine, sequences: list[Tokens], advantages: list[float], pad_id: int,
               micro_batch_size: int, temperatures: list[float], token_loss: TokenLoss,
               echo_weights: list[float] | None = None,
               token_advantages: list[list[float]] | None = None,
               sft_rows: SFTRows | None = None, dense: list[DenseRow | None] | None = None,
               micro_batch_tokens: int | None = None, pack: bool = False) -> dict[str, float]:
    """One optimizer step over ``sequences``, each recomputed at its temperature (what it was
    sampled at); returns the step's figures. ``echo_weights``: by sequence, the weight of the
    mean cross-entropy on its environment tokens (``Tokens.env_mask``) added to the loss on its
    loss-mask tokens (None: no echo term). ``token_advantages``: by sequence, a per-token part of
    its advantage, aligned with its tokens (None: none). ``sft_rows``: examples whose loss-mask
    tokens' mean cross-entropy, each row times its weight, joins the loss (an SFT term).
    ``dense``: by sequence, its dense distillation target or None: each sampled position's
    divergence to the teacher's top-k, times its weight, joins the loss, normalised as the
    policy-gradient loss is. ``micro_batch_tokens``: a pass's padded tokens at most (None: no
    bound but ``micro_batch_size``). ``pack``: the loss's logprobs from the micro-batch packed
    (``trainer.pack``: :func:`flywheel_trainer.batch.packed_loss_logprobs`)."""
    started = time.perf_counter()
    num_loss_tokens = sum(sum(s.loss_mask[1:]) for s in sequences)
    num_env_tokens = 0 if echo_weights is None else sum(
        sum(s.env_mask[1:]) for s, weight in zip(sequences, echo_weights, strict=True) if weight > 0)
    num_sft_tokens = 0 if sft_rows is None else sum(sum(s.loss_mask[1:]) for s in sft_rows.rows)
    num_tokens = sum(len(s.token_ids) for s in sequences)
    figures = {"loss": 0.0, "num_loss_tokens": float(num_loss_tokens), "num_tokens": float(num_tokens),
               "num_sequences": float(len(sequences))}
    if echo_weights is not None:
        figures.update(echo_loss=0.0, num_env_tokens=float(num_env_tokens))
    if sft_rows is not None:
        figures.update(sft_term_loss=0.0, num_sft_tokens=float(num_sft_tokens))
    if dense is not None:
        figures.update(distill_loss=0.0)
    if num_loss_tokens == 0 and num_env_tokens == 0 and num_sft_tokens == 0:
        log.warning("step with no loss tokens (%d sequences): weights unchanged", len(sequences))
        figures.update(grad_norm=0.0, step_s=time.perf_counter() - started)
        return figures
    flagged = diff_sum = 0.0
    # Every micro-batch of the step, the RL loss's then the SFT term's; on several ranks each
    # takes every world_size-th, and one with fewer makes idle passes (see flywheel_trainer.ranks).
    ranks = current_ranks()
    rank, world_size = ranks.rank, ranks.world_size
    passes = [(False, indices) for indices in micro_batches(sequences, micro_batch_size, micro_batch_tokens,
                                                            world_size)]
    if sft_rows is not None and num_sft_tokens:
        passes += [(True, indices) for indices in micro_batches(sft_rows.rows, micro_batch_size, micro_batch_tokens,
                                                                world_size)]
    # A prefix is shared through a key/value cache, which checkpointed layers drop (packing finds
    # shared beginnings in whole rows itself).
    share = (can_share_prefixes(engine.model) and not (world_size > 1 and engine.same_graph_on_every_rank)
             and not getattr(engine, "activation_checkpointing", False))
    mine = passes[rank::world_size]
    for is_sft, indices in mine:
        if is_sft:
            assert sft_rows is not None
            _sft_term(engine, sft_rows, indices, pad_id, num_sft_tokens, share, figures)
            continue
        batch = pad([sequences[i] for i in indices], [advantages[i] for i in indices], pad_id, engine.device,
                    [temperatures[i] for i in indices], share_prefixes=share,
                    echo_weights=None if echo_weights is None else [echo_weights[i] for i in indices],
                    token_advantages=None if token_advantages is None else [token_advantages[i] for i in indices],
                    dense=None if dense is None else [dense[i] for i in indices])
        with engine.autocast():
            if batch.env_mask is None and batch.dense is None and getattr(engine, "head_at_loss_positions", False):
                # the loss reads its tokens' logprobs alone
                at_loss = packed_loss_logprobs if pack else loss_logprobs
                logits, logprobs, plain = None, at_loss(engine.model, batch, engine.module), None
            else:
                logits = batch_logits(engine.model, batch)
                logprobs = target_logprobs(logits, batch, batch.temperatures)
                # Echo predicts the environment's tokens under the model's own distribution.
                plain = None if batch.env_mask is None else (
                    logprobs if bool((batch.temperatures == 1.0).all()) else target_logprobs(logits, batch, None))
        per_token, flags = token_loss(logprobs, batch, indices)
        mask = batch.loss_mask
        loss = (per_token * mask).sum() / max(num_loss_tokens, 1)
        if num_env_tokens and plain is not None and batch.env_mask is not None and batch.echo_weights is not None:
            nll = -plain * batch.env_mask  # [B, T-1]: 0 off the environment's tokens
            loss = loss + (nll.sum(-1) * batch.echo_weights).sum() / num_env_tokens
            figures["echo_loss"] += float(nll.detach().sum()) / num_env_tokens
        if batch.dense is not None:
            assert logits is not None  # computed whole for the dense term
            divergence = _dense_divergence(logits, batch, batch.dense)
            loss = loss + (divergence * batch.dense.coef).sum() / max(num_loss_tokens, 1)
            figures["distill_loss"] += float(divergence.detach().sum()) / max(num_loss_tokens, 1)
        engine.backward(loss)
        figures["loss"] += float(loss.detach())
        flagged += float((flags & mask).sum())
        diff_sum += float(((logprobs.detach() - batch.old_logprobs).abs() * mask).sum())
    for _ in range(-(-len(passes) // world_size) - len(mine)):
        engine.idle_backward()
    if world_size > 1:
        summed = [k for k in LOSS_FIGURES if k in figures]
        *totals, flagged, diff_sum = sum_over_ranks([figures[k] for k in summed] + [flagged, diff_sum])
        figures.update(zip(summed, totals, strict=True))
    figures["grad_norm"] = engine.step()
    if not all(math.isfinite(figures[k]) for k in ("grad_norm", *LOSS_FIGURES) if k in figures):
        # The engine discarded the gradients (Engine.step): the weights stay as they were.
        log.warning("step skipped: its loss or gradients are not finite (%s); the weights are unchanged",
                    ", ".join(f"{k} {figures[k]}" for k in ("grad_norm", *LOSS_FIGURES) if k in figures))
        figures["num_skipped_nonfinite"] = 1.0
    figures["clip_fraction"] = flagged / max(num_loss_tokens, 1)
    # How far the trainer's logprobs are from the sampler's on the loss tokens: ~0 on
    # policy; grows with staleness (and flags a trainer/inference mismatch when it does not).
    figures["logprob_diff_abs_mean"] = diff_sum / max(num_loss_tokens, 1)
    figures["step_s"] = time.perf_counter() - started
    figures["tokens_per_s"] = num_tokens / figures["step_s"]
    return figures


def _dense_divergence(logits: torch.Tensor, batch: Batch, dense: DenseTargets) -> torch.Tensor:
    """The divergence to the teacher's top-k at each of ``dense``'s positions ``[N]``, the policy's
    distribution at its row's temperature (the teacher's values are at the same one); the
    log-softmax is taken at those positions only."""
    picked = logits[dense.rows, dense.columns].float() / batch.temperatures[dense.rows, None]
    return top_k_divergence(torch.log_softmax(picked, dim=-1), dense.top_ids, dense.top_logprobs, dense.valid,
                            dense.forward)


def _sft_term(engine: Engine, sft_rows: SFTRows, indices: list[int], pad_id: int, num_sft_tokens: int,
              share: bool, figures: dict[str, float]) -> None:
    """One backward pass of the SFT term (the weighted mean cross-entropy at temperature 1 of
    its rows ``indices``), into the gradient the step's RL loss left; its mean cross-entropy
    into ``figures``."""
    batch = pad([sft_rows.rows[i] for i in indices], [0.0] * len(indices), pad_id, engine.device,
                share_prefixes=share)
    weights = torch.tensor([sft_rows.weights[i] for i in indices], dtype=torch.float32, device=engine.device)
    with engine.autocast():
        logprobs = target_logprobs(batch_logits(engine.model, batch), batch, None)
    nll = -logprobs * batch.loss_mask  # [B, T-1]: 0 off the answers' tokens
    loss = (nll.sum(-1) * weights).sum() / num_sft_tokens
    engine.backward(loss)
    figures["loss"] += float(loss.detach())
    figures["sft_term_loss"] += float(nll.detach().sum()) / num_sft_tokens


def rl_step(engine: Engine, groups: list[list[Scored]], pad_id: int, cfg: RunConfig,
            micro_batch_size: int, envs: Mapping[str, EnvConfig] | None = None,
            sft_rows: SFTRows | None = None, micro_batch_tokens: int | None = None) -> dict[str, float]:
    """One RL step on whole groups: advantages, importance-weighted loss, engine step.
    ``envs``: the run's environments by their name in subjects (a rollout's ``env``), whose
    own advantage and loss its groups take; a rollout of another takes the run's. ``sft_rows``:
    the step's SFT term (:class:`SFTSupply`), if the run has one."""
    envs = envs or {}
    advantage_fns = {name: cfg.advantage_of(env).bind(ADVANTAGES) for name, env in envs.items()}
    run_advantage = cfg.trainer.advantage.bind(ADVANTAGES)
    loss_parts = [cfg.trainer.loss, *(cfg.loss_of(env) for env in envs.values())]
    losses: list[LossPart] = []  # each distinct part once (equal parts are one), the run's first
    for part in loss_parts:
        if part not in losses:
            losses.append(part)
    loss_fns = [part.bind(LOSSES) for part in losses]
    loss_index = {name: losses.index(cfg.loss_of(env)) for name, env in envs.items()}
    sequences: list[Tokens] = []
    advantages: list[float] = []
    temperatures: list[float] = []
    loss_of: list[int] = []  # by sequence: which of loss_fns
    echo_of = {name: cfg.echo_of(env) for name, env in envs.items()}
    echo_weights: list[float] = []  # by sequence
    terms_of = {name: cfg.token_terms_of(env) for name, env in envs.items()}
    run_terms = cfg.trainer.advantage.token_terms() + (
        [(cfg.trainer.kl.teacher, cfg.trainer.kl.coef)] if cfg.trainer.kl is not None else [])
    token_advantages: list[list[float]] = []  # by sequence, aligned with its tokens
    dense_of = {name: cfg.advantage_of(env).dense_term() for name, env in envs.items()}
    run_dense = cfg.trainer.advantage.dense_term()
    dense: list[DenseRow | None] = []  # by sequence: its dense distillation target
    envs_of: list[str] = []  # by sequence: its rollout's environment
    teacher_gap: dict[str, list[float]] = {}  # teacher -> [sum of sampled - teacher logprob, tokens]
    with_terms = bool(run_terms) or any(terms_of.values())
    for group in groups:
        env = group[0].rollout.env
        advantage_fn = advantage_fns.get(env, run_advantage)
        terms = terms_of.get(env, run_terms)
        for scored, advantage in zip(group, advantage_fn([s.reward for s in group]), strict=True):
            # What the rollout was sampled at (a task may set its own); the run's for a rollout
            # that does not say.
            temperature = (scored.rollout.sampling or cfg.sampling).temperature
            sequences_here = scored.sequences  # one per branch of its trace graph
            # A run without teacher terms carries no per-token part at all.
            by_token = (_token_terms(scored, sequences_here, terms, teacher_gap) if with_terms
                        else [[] for _ in sequences_here])
            term = dense_of.get(env, run_dense)
            tops: list[TopK | None] = [None] * len(sequences_here)
            if term is not None:
                signal = scored.signals[term.teacher]
                tops = list(signal_top(scored.rollout, signal))
                _add_gap(sequences_here, signal_values(scored.rollout, signal),
                         teacher_gap.setdefault(term.teacher, [0.0, 0.0]))
            for sequence, per_token, top in zip(sequences_here, by_token, tops, strict=True):
                dense.append(None if top is None or term is None else DenseRow(top, term.coef, term.forward))
                sequences.append(sequence)
                advantages.append(advantage)
                temperatures.append(temperature)
                loss_of.append(loss_index.get(env, 0))
                echo_weights.append(echo_of.get(env, cfg.trainer.echo))
                token_advantages.append(per_token)
                envs_of.append(env)

    if with_terms:
        _center(sequences, token_advantages, envs_of)

    def token_loss(logprobs: torch.Tensor, batch: Batch, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kinds = [loss_of[i] for i in indices]
        by_token = batch.advantages_by_token()
        if len(set(kinds)) == 1:
            return loss_fns[kinds[0]](logprobs, batch.old_logprobs, by_token)
        per_token = torch.zeros_like(logprobs)
        flags = torch.zeros_like(batch.loss_mask)
        for kind in sorted(set(kinds)):
            rows = torch.tensor([row for row, k in enumerate(kinds) if k == kind], device=logprobs.device)
            part, part_flags = loss_fns[kind](logprobs[rows], batch.old_logprobs[rows], by_token[rows])
            per_token = per_token.index_copy(0, rows, part)
            flags[rows] = part_flags.to(flags.dtype)
        return per_token, flags

    any_terms = with_terms and any(teacher_gap)
    figures = train_step(engine, sequences, advantages, pad_id, micro_batch_size, temperatures, token_loss,
                         echo_weights if any(w > 0 for w in echo_weights) else None,
                         token_advantages if any_terms else None, sft_rows, dense if any(dense) else None,
                         micro_batch_tokens, cfg.trainer.pack)
    figures["advantage_abs_mean"] = sum(abs(a) for a in advantages) / len(advantages)
    for teacher, (gap, count) in teacher_gap.items():
        # The per-token estimate of KL(policy || teacher) on the sampled tokens: OPD drives it down.
        figures[f"teacher.{teacher}.kl"] = gap / max(count, 1.0)
    return figures


def _center(sequences: list[Tokens], token_advantages: list[list[float]], envs_of: list[str]) -> None:
    """Subtract from the per-token part of each environment's advantages its mean over the step's
    sampled tokens of that environment: a baseline, which leaves the expected gradient as it is.
    The raw term, a logprob gap, is mostly negative (the policy's own samples are likelier under
    it than under a teacher), so uncentered it pushes nearly every sampled token down at once."""
    for env in dict.fromkeys(envs_of):
        rows = [i for i, e in enumerate(envs_of) if e == env]
        values = [v for i in rows for v, trained in zip(token_advantages[i], sequences[i].loss_mask, strict=True)
                  if trained]
        if not values or not any(values):
            continue
        mean = sum(values) / len(values)
        for i in rows:
            token_advantages[i] = [v - mean if trained else 0.0
                                   for v, trained in zip(token_advantages[i], sequences[i].loss_mask, strict=True)]


def _token_terms(scored: Scored, sequences: list[Tokens], terms: list[tuple[str, float]],
                 gap: dict[str, list[float]]) -> list[list[float]]:
    """The per-token part of each of ``scored``'s sequences' advantages: for each (teacher, coef)
    of ``terms``, ``coef`` x (the teacher's logprob - the sampled logprob) on every sampled token
    (0 elsewhere); adds each teacher's gap and token count to ``gap``."""
    out = [[0.0] * len(s.token_ids) for s in sequences]
    for teacher, coef in terms:
        values = signal_values(scored.rollout, scored.signals[teacher])
        _add_gap(sequences, values, gap.setdefault(teacher, [0.0, 0.0]))
        for sequence, teacher_logprobs, per_token in zip(sequences, values, out, strict=True):
            for j, trained in enumerate(sequence.loss_mask):
                if trained:
                    per_token[j] -= coef * (sequence.logprobs[j] - teacher_logprobs[j])
    return out


def _add_gap(sequences: list[Tokens], teacher_logprobs: list[list[float]], totals: list[float]) -> None:
    """Add to ``totals`` ([sum, count]) (the sampled - the teacher's logprob) of every sampled token."""
    for sequence, values in zip(sequences, teacher_logprobs, strict=True):
        for j, trained in enumerate(sequence.loss_mask):
            if trained:
                totals[0] += sequence.logprobs[j] - values[j]
                totals[1] += 1.0


def seed_torch(seed: int) -> None:
    """Seed torch's random state (a seeded run: whatever in the model or optimizer draws
    random numbers draws the same ones)."""
    torch.manual_seed(seed)


def _cross_entropy(logprobs: torch.Tensor, batch: Batch, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return -logprobs, torch.zeros_like(batch.loss_mask)


def sft_step(engine: Engine, sequences: list[Tokens], pad_id: int, micro_batch_size: int,
             micro_batch_tokens: int | None = None, pack: bool = False) -> dict[str, float]:
    """One supervised step: cross-entropy on the loss-mask tokens of ``sequences`` (temperature 1),
    the warm-up's and ``flywheel sft``'s."""
    return train_step(engine, sequences, [0.0] * len(sequences), pad_id, micro_batch_size, [1.0] * len(sequences),
                      _cross_entropy, micro_batch_tokens=micro_batch_tokens, pack=pack)


Example = tuple[list[events.Message], str]  # a task's first messages (a context first, if any) and its reference answer


def reference_tokens(tok: Any, messages: Sequence[events.Message], answer: str) -> Tokens:
    """The prompt as inference renders it (``messages``: the task's first messages, with a
    privileged context first, as a self-distillation teacher sees them), then the reference
    ``answer`` and end of turn, to learn."""
    prompt = models.render_prompt(tok, list(messages))
    ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    return Tokens(token_ids=prompt + ids, logprobs=[0.0] * (len(prompt) + len(ids)),
                  loss_mask=[False] * len(prompt) + [True] * len(ids))


async def reference_examples(envs: Sequence[WorkerEnvironment], cfg: RunConfig) -> list[Example]:
    """The warm-up's ``cfg.sft.steps`` x ``cfg.sft.batch_size`` reference examples, from the
    environments' workers: the environments (in the config's order) mixed by their weights, tasks
    in the run's seeded order; with ``sft.context``, a seeded ``sft.context_share`` of them shown
    with that context."""
    schedule = cfg.env_schedule(cfg.sft.steps * cfg.sft.batch_size)
    rows = {i: iter(await env.load_tasks(schedule.count(i), seed=cfg.task_seed)) for i, env in enumerate(envs)
            if schedule.count(i)}
    tasks = [(i, next(rows[i])) for i in schedule]
    shown = random.Random(f"{cfg.task_seed}/sft-context")
    contexts = [cfg.sft.context if cfg.sft.context is not None and shown.random() < cfg.sft.context_share else None
                for _ in tasks]
    examples: list[Example | None] = [None] * len(tasks)
    for i, env in enumerate(envs):
        places = [n for n, (which, _) in enumerate(tasks) if which == i]
        if places:
            found = await env.references([tasks[n][1] for n in places], [contexts[n] for n in places])
            for n, example in zip(places, found, strict=True):
                examples[n] = example
    return [e for e in examples if e is not None]


def reference_steps(tok: Any, examples: Sequence[Example], cfg: RunConfig) -> list[list[Tokens]]:
    """``examples`` (:func:`reference_examples`) as the warm-up's ``cfg.sft.steps`` batches of
    ``cfg.sft.batch_size`` token rows."""
    size = cfg.sft.batch_size
    rows = [reference_tokens(tok, messages, answer) for messages, answer in examples]
    return [rows[step * size:(step + 1) * size] for step in range(cfg.sft.steps)]


async def term_references(environments: Mapping[str, tuple[EnvConfig, WorkerEnvironment]], cfg: RunConfig
                          ) -> dict[str, list[Example]]:
    """The reference examples each environment's SFT term draws from (:class:`SFTSupply`), from
    its workers: up to :attr:`SFTSupply.POOL` tasks in the run's seeded order, for each term that
    has neither ``data`` nor ``dataset``."""
    out: dict[str, list[Example]] = {}
    for name, (env_cfg, env) in environments.items():
        term = cfg.sft_term_of(env_cfg)
        if term is None or term.data or term.dataset:
            continue
        tasks = await env.load_tasks(min(SFTSupply.POOL, term.batch_size * cfg.trainer.num_steps),
                                     seed=cfg.task_seed)
        out[name] = await env.references(tasks)
    return out


@dataclass
class SFTRows:
    """One step's SFT-term examples, and each one's weight (its environment's term's)."""

    rows: list[Tokens]
    weights: list[float]


class SFTSupply:
    """Each step's SFT-term rows: for every environment with a term (``[[envs]] sft_term``, else
    ``trainer.sft_term``), ``batch_size`` examples drawn from its reference answers (a pool of up
    to :attr:`POOL` tasks in the run's seeded order: :func:`term_references`) or from the term's
    ``data`` file or ``dataset``. Which ones follows from the run's task seed, the environment and
    the step alone, so a resumed run draws what it would have drawn."""

    POOL = 1024  # reference answers per environment to draw from

    def __init__(self, tok: Any, envs: Mapping[str, EnvConfig], references: Mapping[str, Sequence[Example]],
                 cfg: RunConfig, max_positions: int | None = None) -> None:
        self.seed = cfg.task_seed
        self.pools: list[tuple[str, list[Tokens], SFTTerm]] = []
        for index, (name, env_cfg) in enumerate(envs.items()):
            term = cfg.sft_term_of(env_cfg)
            if term is None:
                continue
            field = f"envs.{index}.sft_term" if env_cfg.sft_term is not None else "trainer.sft_term"
            if term.data:
                examples = load_examples(Path(term.data), tok, max_positions, f"{field}.data")
            elif term.dataset:
                examples = load_dataset_examples(term.dataset, term.split, tok, max_positions, f"{field}.dataset")
            else:
                examples = [reference_tokens(tok, messages, answer) for messages, answer in references[name]]
            self.pools.append((name, examples, term))

    def __bool__(self) -> bool:
        return bool(self.pools)

    def rows(self, step: int) -> SFTRows:
        """Step ``step``'s rows (the same for the same step, in any process)."""
        rows: list[Tokens] = []
        weights: list[float] = []
        for name, examples, term in self.pools:
            drawn = random.Random(f"{self.seed}/{name}/{step}").sample(range(len(examples)),
                                                                      min(term.batch_size, len(examples)))
            rows += [examples[i] for i in drawn]
            weights += [term.weight] * len(drawn)
        return SFTRows(rows, weights)


def warmup_steps(model: torch.nn.Module, tok: Any, examples: Sequence[Example], cfg: RunConfig
                 ) -> list[list[Tokens]]:
    """The warm-up's ``cfg.sft.steps`` batches: reference ``examples`` (:func:`reference_examples`);
    with ``sft.data`` or ``sft.dataset``, those chats instead (as ``flywheel sft`` learns them)."""
    assert cfg.sft.steps > 0
    if cfg.sft.data or cfg.sft.dataset:
        chats = sft_examples(cfg.sft, tok, getattr(model.config, "max_position_embeddings", None))
        drawn = batches(len(chats), cfg.sft.batch_size, cfg.task_seed)
        return [[chats[i] for i in next(drawn)[1]] for _ in range(cfg.sft.steps)]
    return reference_steps(tok, examples, cfg)


def sft_warmup(model: torch.nn.Module, steps: list[list[Tokens]], pad_id: int, cfg: RunConfig,
               micro_batch_size: int, micro_batch_tokens: int | None = None) -> dict[str, float]:
    """A step of cross-entropy on each batch of ``steps`` (:func:`warmup_steps`), with an
    optimizer of its own; on several ranks, each takes its share of every step's micro-batches."""
    engine = TorchEngine(model, cfg.trainer.model_copy(update={"lr": cfg.sft.lr}), cfg.model.dtype)
    started = time.perf_counter()
    figures: dict[str, float] = {}
    num_tokens = 0
    for step, sequences in enumerate(steps):
        figures = sft_step(engine, sequences, pad_id, micro_batch_size, micro_batch_tokens, cfg.trainer.pack)
        num_tokens += int(figures["num_loss_tokens"])
        log.info("sft step %d/%d: loss %.4f", step + 1, cfg.sft.steps, figures["loss"])
    model.eval()
    return {"sft_steps": float(cfg.sft.steps), "sft_loss": figures["loss"], "sft_s": time.perf_counter() - started,
            "sft_tokens": float(num_tokens)}
