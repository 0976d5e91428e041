"""The join: rollouts meet their scores, group by group, until a step can take them.

Rollouts and scores arrive on two streams, in any order and more than once (delivery is
at least once), so the :class:`Joiner` upserts both by id and decides readiness from what
it holds, never from arrival order:

- a rollout is *ready* when every required scorer (its environment's in a run with several,
  else the run's: :func:`flywheel.contract.runs.scorers_of`) has scored it; its
  reward is theirs weighted and summed (:func:`flywheel.sdk.scoring.rollout_reward`, the
  definition the trace API and ``flywheel eval`` use too);
- in a run with teachers (``[teachers.<name>]``), a rollout whose environment's advantage or
  KL term reads a teacher (:meth:`flywheel.contract.config.RunConfig.teachers_of`) is ready
  only once that teacher's :class:`~flywheel.contract.events.Signal` is here too (its logprobs
  of the rollout's sampled tokens, joined like a score);
- a rollout is *dropped* (counted, never trained, never a silent zero) when inference
  marked it ``error``, when a required scorer failed on it (a score with ``error`` set),
  when a required teacher could not score it (a signal with ``error``), or when it is
  *stale*: its ``policy_version`` is more than ``max_off_policy_steps`` behind the version
  being trained; staleness is checked on arrival and again whenever the
  version moves on;
- a group is *done* when all ``group_size`` of its rollouts are here and each is ready or
  dropped. :meth:`Joiner.take` hands out whole done groups, oldest first (in the take:
  ordered by their tasks' seeds, then ids, each group's rollouts by index, so a seeded
  run's sums do not depend on arrival order); a done group whose rollouts were all dropped
  is consumed along with them and counted (:attr:`Take.unused`: what the run makes again; a
  group that trains some of its rollouts counts in its step, its dropped ones cost nothing more).

Ids of consumed rollouts (trained or dropped) are remembered, so a redelivered rollout or
a late score for one is recognised and ignored. Plain Python, no I/O: the service
persists what this holds (see :mod:`flywheel_trainer.ledger`).

A rollout is trained as one sequence per branch of its trace graph (:func:`sequences_of`).
Group rewards are scores like any other (the scorer publishes one per rollout). Not
covered: groups that never complete (a member inference
never publishes keeps its group waiting; ``max_buffered_rollouts`` bounds the cost).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

import msgspec

from flywheel.contract import events
from flywheel.sdk.scoring import rollout_reward
from flywheel.sdk.tracegraph import TokenLayerError, Tokens, branches, join_tokens

T = TypeVar("T")

DROP_REASONS = ("stale", "scorer_error", "rollout_error", "signal_error")


def _seed_of(rollout: events.Rollout) -> int:
    """The seed of a rollout's task (its seed less its index); -1 when it was not seeded."""
    if rollout.sampling is None or rollout.sampling.seed is None:
        return -1
    return (rollout.sampling.seed - rollout.index) % (events.INT32_MAX + 1)


class BadRollout(ValueError):
    """A rollout that can never be trained (its token layer is inconsistent, its group overfull)."""


ENVIRONMENT_ROLES = ("user", "tool")


def environment_mask(nodes: list[events.Node], trained: set[str]) -> list[bool]:
    """Which tokens of ``nodes``' joined spans the environment wrote after the model's first
    answer: the spans of user and tool messages (a tool's result, the simulated user's next turn,
    with their chat template) that follow the first node with a sampled token. The task's own
    prompt, system messages, whatever the model sampled, and nodes of ``trained`` (a branch
    trained before holds them) are not. Echo's cross-entropy goes on these and only these."""
    mask: list[bool] = []
    answered = False
    for node in nodes:
        if node.tokens is None:
            continue
        n = len(node.tokens.token_ids)
        mask += [answered and node.message.role in ENVIRONMENT_ROLES and node.id not in trained] * n
        answered = answered or any(node.tokens.loss_mask)
    return mask


def _span_tokens(rollout: events.Rollout, nodes: list[events.Node], trained: set[str]) -> Tokens:
    """``nodes``' spans joined (:func:`flywheel.sdk.tracegraph.join_tokens`), nodes of ``trained``
    as context, with their environment tokens marked (:func:`environment_mask`); BadRollout when
    the layer cannot be trained."""
    try:
        tokens = join_tokens(nodes, context=trained, strict=True)
    except TokenLayerError as exc:
        raise BadRollout(f"rollout {rollout.id} {exc}") from None
    if not tokens.token_ids:
        raise BadRollout(f"rollout {rollout.id} has no tokens")
    if tokens.loss_mask[0]:
        raise BadRollout(f"rollout {rollout.id}: its first token is marked for the loss, but nothing predicts it")
    return replace(tokens, env_mask=environment_mask(nodes, trained))


def _trained_branches(rollout: events.Rollout) -> list[tuple[list[events.Node], Tokens]]:
    """Each branch with something to train, with its sequence (see :func:`sequences_of`)."""
    out: list[tuple[list[events.Node], Tokens]] = []
    trained: set[str] = set()
    for branch in branches(rollout.nodes):
        tokens = _span_tokens(rollout, branch, trained)
        trained.update(n.id for n in branch)
        if any(tokens.loss_mask):
            out.append((branch, tokens))
    if not out:
        raise BadRollout(f"rollout {rollout.id} has no sampled tokens to train on")
    return out


def sequences_of(rollout: events.Rollout) -> list[Tokens]:
    """One sequence per branch of the rollout's trace graph (root to leaf: exactly the tokens the
    model saw and sampled there), each sampled token in the loss once: a node shared by several
    branches is trained in the first and is context in the others. Branches left with nothing
    to train are skipped. Raises :class:`BadRollout` when spans do not line up."""
    return [tokens for _, tokens in _trained_branches(rollout)]


def signal_values(rollout: events.Rollout, signal: events.Signal) -> list[list[float]]:
    """A signal's per-node values laid out as :func:`sequences_of`'s sequences, token by token
    (0.0 where the signal has no value: a node without sampled tokens). BadRollout when a node's
    values do not match its span's length."""
    return _laid_out(rollout, signal, "values", signal.values, 0.0)


@dataclass(frozen=True)
class TopK:
    """A teacher's likeliest tokens at each position of one sequence, aligned with its tokens
    (an empty list where it gave none: a token the policy did not sample)."""

    ids: list[list[int]]
    logprobs: list[list[float]]


def signal_top(rollout: events.Rollout, signal: events.Signal) -> list[TopK]:
    """A signal's top-k tokens (``Signal.top_ids``, ``top_logprobs``) laid out as
    :func:`sequences_of`'s sequences. BadRollout when a node's lists do not match its span's
    length, or a token's ids and logprobs differ in number."""
    ids = _laid_out(rollout, signal, "top_ids", signal.top_ids, [])
    logprobs = _laid_out(rollout, signal, "top_logprobs", signal.top_logprobs, [])
    for sequence_ids, sequence_logprobs in zip(ids, logprobs, strict=True):
        for j, (a, b) in enumerate(zip(sequence_ids, sequence_logprobs, strict=True)):
            if len(a) != len(b):
                raise BadRollout(f"signal {signal.id}: token {j} of a branch has {len(a)} top ids but "
                                 f"{len(b)} top logprobs")
    return [TopK(a, b) for a, b in zip(ids, logprobs, strict=True)]


def _laid_out(rollout: events.Rollout, signal: events.Signal, what: str, by_node: Mapping[str, list[T]],
              default: T) -> list[list[T]]:
    """``by_node`` (a field of ``signal``, ``what``) laid out as :func:`sequences_of`'s sequences,
    ``default`` at the tokens of a node it does not name."""
    out: list[list[T]] = []
    for branch, tokens in _trained_branches(rollout):
        laid: list[T] = []
        for node in branch:
            if node.tokens is None:
                continue
            n = len(node.tokens.token_ids)
            given = by_node.get(node.id)
            if given is not None and len(given) != n:
                raise BadRollout(f"signal {signal.id}: node {node.id} has {n} tokens but {len(given)} {what}")
            laid += given if given is not None else [default] * n
        assert len(laid) == len(tokens.token_ids)
        out.append(laid)
    return out


def tokens_of(rollout: events.Rollout) -> Tokens:
    """The rollout's nodes' token spans concatenated in order (a single-chain rollout's sequence)."""
    return _span_tokens(rollout, list(rollout.nodes), set())


@dataclass(frozen=True)
class Scored:
    """A ready rollout with its reward and how many versions behind it was when taken."""

    rollout: events.Rollout
    reward: float
    staleness: int
    scores: dict[str, float] = field(default_factory=dict)  # each required scorer's value (metrics too)
    signals: dict[str, events.Signal] = field(default_factory=dict)  # each required teacher's, by its name
    _sequences: list[Tokens] | None = field(default=None, repr=False)  # the joiner's, from its check

    @property
    def sequences(self) -> list[Tokens]:
        """:func:`sequences_of` the rollout, computed once."""
        if self._sequences is None:
            object.__setattr__(self, "_sequences", sequences_of(self.rollout))  # a cache: frozen for its fields
        assert self._sequences is not None
        return self._sequences


@dataclass
class Take:
    """What one step consumes: whole groups to train, and the rollouts dropped with them."""

    groups: list[list[Scored]]
    dropped: dict[str, str] = field(default_factory=dict)  # rollout id -> reason
    # Dropped for an error: rollout id -> (where it failed: "rollout", "scorer NAME", "teacher
    # NAME"; the error's text), for the run's error groups.
    errors: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The rollouts of the groups taken with nothing to train (every member dropped): the step
    # counts only groups that train, so each of these is a group the run makes again.
    unused: list[str] = field(default_factory=list)

    @property
    def trained_ids(self) -> list[str]:
        return [s.rollout.id for g in self.groups for s in g]

    def num_dropped(self, reason: str) -> int:
        assert reason in DROP_REASONS
        return Counter(self.dropped.values())[reason]


# What differs between errors of one kind: numbers, hex ids, quoted values are left as they are.
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{8,}\b|\d+(?:\.\d+)?")
OTHER_ERRORS = "other errors (the run keeps {} kinds apart; the trace API has each: ?error=true)"


def _kind(source: str, error: str) -> tuple[str, str]:
    return source, _VARYING.sub("#", error)


def add_errors(groups: Iterable[events.ErrorGroup], errors: Mapping[str, tuple[str, str]]
               ) -> list[events.ErrorGroup]:
    """``groups`` (a run's ``RunState.errors``) with ``errors`` counted in (a step's dropped
    rollouts: id -> (source, text)): one group per source and text up to its numbers and ids,
    the first one's text and rollout kept, most frequent first. Past ``MAX_ERROR_GROUPS`` kinds,
    a new kind counts in its source's "other errors" group."""
    by_kind = {_kind(g.source, g.error): g for g in groups}
    for rollout_id, (source, given) in errors.items():
        text = given
        if _kind(source, text) not in by_kind and len(by_kind) >= events.MAX_ERROR_GROUPS:
            text = OTHER_ERRORS.format(events.MAX_ERROR_GROUPS)
        kind = _kind(source, text)
        found = by_kind.get(kind)
        by_kind[kind] = (events.ErrorGroup(source=source, error=text[:events.MAX_ERROR_CHARS], count=1,
                                           example=rollout_id) if found is None
                         else msgspec.structs.replace(found, count=found.count + 1))
    return sorted(by_kind.values(), key=lambda g: -g.count)


class Joiner:
    """Buffers rollouts and scores of one run until their groups are done."""

    def __init__(self, scorers: Mapping[str, float], max_off_policy_steps: int, version: int = 0,
                 consumed: Iterable[str] = (), env_scorers: Mapping[str, Mapping[str, float]] | None = None,
                 signals: Collection[str] = (), env_signals: Mapping[str, Collection[str]] | None = None) -> None:
        """``scorers``: the run's reward (name -> weight); ``env_scorers``: a run with several
        environments, each one's (by its name in subjects), for its rollouts. ``signals`` and
        ``env_signals``: likewise, the teachers whose signals a rollout waits for."""
        if not scorers:
            raise ValueError("scorers: at least one scorer makes the reward")
        self.scorers = dict(scorers)
        self.env_scorers = {env: dict(by_name) for env, by_name in (env_scorers or {}).items()}
        for env, by_name in self.env_scorers.items():
            if not by_name:
                raise ValueError(f"env_scorers[{env!r}]: at least one scorer makes the reward")
        self._any_scorer = set(self.scorers).union(*self.env_scorers.values())
        self.signals = set(signals)
        self.env_signals = {env: set(sources) for env, sources in (env_signals or {}).items()}
        self._any_signal = self.signals.union(*self.env_signals.values())
        self._signals: dict[str, dict[str, events.Signal]] = {}  # rollout id -> source -> signal
        self.max_off_policy_steps = max_off_policy_steps
        self.version = version
        self.consumed: set[str] = set(consumed)
        self._rollouts: dict[str, events.Rollout] = {}
        self._scores: dict[str, dict[str, events.Score]] = {}  # rollout id -> scorer -> score
        self.flagged: set[str] = set()  # rollouts the reward-hacking watch flagged, until a step takes them
        self._groups: dict[str, list[str]] = {}  # group id -> rollout ids, oldest group first
        self._dropped: dict[str, str] = {}  # buffered rollout id -> reason
        self._errors: dict[str, tuple[str, str]] = {}  # buffered rollout id dropped for an error -> (source, error)
        self._sequences: dict[str, list[Tokens]] = {}  # buffered rollout id -> its sequences (check's)

    # --- input ------------------------------------------------------------------------

    def check(self, rollout: events.Rollout) -> list[Tokens]:
        """Raise :class:`BadRollout` for a rollout that can never be trained (before any side
        effect); its sequences (:func:`sequences_of`; none for a rollout that failed) otherwise."""
        if rollout.group_size < 1:
            raise BadRollout(f"rollout {rollout.id}: group_size={rollout.group_size}")
        sequences = sequences_of(rollout) if rollout.status != "error" else []
        members = self._groups.get(rollout.group_id, [])
        if members and rollout.id not in self._rollouts:
            size = self._rollouts[members[0]].group_size
            if rollout.group_size != size:
                raise BadRollout(f"rollout {rollout.id}: group_size={rollout.group_size}, but group "
                                 f"{rollout.group_id} has group_size={size}")
            if len(members) >= size:
                raise BadRollout(f"rollout {rollout.id}: group {rollout.group_id} already has its {size} rollouts")
        return sequences

    def add_rollout(self, rollout: events.Rollout, sequences: list[Tokens] | None = None) -> bool:
        """Buffer ``rollout``; False when it was consumed or is buffered already. ``sequences``:
        what :meth:`check` returned for it (None: it is checked here)."""
        if rollout.id in self.consumed or rollout.id in self._rollouts:
            return False
        self._sequences[rollout.id] = self.check(rollout) if sequences is None else sequences
        self._rollouts[rollout.id] = rollout
        self._groups.setdefault(rollout.group_id, []).append(rollout.id)
        self._check_signals(rollout.id)
        self._update(rollout.id)
        return True

    def add_score(self, score: events.Score) -> bool:
        """Buffer ``score``; False when it is not a required scorer's or its rollout was consumed.
        A flag of the reward-hacking watch is kept for the step's ``flagged`` figure."""
        if score.scorer == events.WATCH_SCORER and score.rollout_id not in self.consumed:
            self.flagged.add(score.rollout_id)
            return True
        if score.scorer not in self._any_scorer or score.rollout_id in self.consumed:
            return False
        self._scores.setdefault(score.rollout_id, {})[score.scorer] = score
        if score.rollout_id in self._rollouts:
            self._update(score.rollout_id)
        return True

    def add_signal(self, signal: events.Signal) -> bool:
        """Buffer ``signal``; False when no rollout waits for its source or its rollout was consumed."""
        if signal.source not in self._any_signal or signal.rollout_id in self.consumed:
            return False
        self._signals.setdefault(signal.rollout_id, {})[signal.source] = signal
        if signal.rollout_id in self._rollouts:
            self._check_signals(signal.rollout_id)
            self._update(signal.rollout_id)
        return True

    def _check_signals(self, rollout_id: str) -> None:
        """A signal whose values do not fit its rollout's token layer counts as the teacher's error."""
        rollout = self._rollouts[rollout_id]
        held = self._signals.get(rollout_id, {})
        for source, signal in held.items():
            if signal.error is None and rollout.status != "error":
                try:
                    signal_values(rollout, signal)
                    signal_top(rollout, signal)
                except BadRollout as exc:
                    held[source] = msgspec.structs.replace(signal, values={}, top_ids={}, top_logprobs={},
                                                           error=str(exc))

    def set_version(self, version: int) -> None:
        """The weights being trained are now ``version``: drop what became stale."""
        assert version >= self.version, f"versions only move forward ({self.version} -> {version})"
        self.version = version
        for rollout_id in self._rollouts:
            self._update(rollout_id)

    def _update(self, rollout_id: str) -> None:
        if rollout_id in self._dropped:
            return
        rollout = self._rollouts[rollout_id]
        if self.version - rollout.policy_version > self.max_off_policy_steps:
            self._dropped[rollout_id] = "stale"  # whatever else: inference stops rollouts that went stale
            return
        failed_scores = [(name, s.error) for name, s in sorted(self._scores.get(rollout_id, {}).items())
                         if s.error is not None]
        failed_signals = [(name, s.error) for name, s in sorted(self._signals.get(rollout_id, {}).items())
                          if s.error is not None and name in self.required_signals(rollout_id)]
        if rollout.status == "error":
            self._dropped[rollout_id] = "rollout_error"
            self._errors[rollout_id] = ("rollout", rollout.error or "the rollout failed (it gave no reason)")
        elif failed_scores:
            self._dropped[rollout_id] = "scorer_error"
            self._errors[rollout_id] = (f"scorer {failed_scores[0][0]}", failed_scores[0][1])
        elif failed_signals:
            self._dropped[rollout_id] = "signal_error"
            self._errors[rollout_id] = (f"teacher {failed_signals[0][0]}", failed_signals[0][1])

    # --- state ------------------------------------------------------------------------

    def required(self, rollout_id: str) -> dict[str, float]:
        """The scorers of a buffered rollout's reward: its environment's, else the run's."""
        return self.env_scorers.get(self._rollouts[rollout_id].env, self.scorers)

    def required_signals(self, rollout_id: str) -> set[str]:
        """The teachers whose signals a buffered rollout waits for: its environment's, else the run's."""
        return self.env_signals.get(self._rollouts[rollout_id].env, self.signals)

    def is_ready(self, rollout_id: str) -> bool:
        return (rollout_id not in self._dropped
                and self._scores.get(rollout_id, {}).keys() >= self.required(rollout_id).keys()
                and self._signals.get(rollout_id, {}).keys() >= self.required_signals(rollout_id))

    def reward(self, rollout_id: str) -> float:
        """The rollout's reward as every reader takes it (:func:`flywheel.sdk.scoring.rollout_reward`)."""
        assert self.is_ready(rollout_id)
        reward = rollout_reward(self._rollouts[rollout_id].status, self._scores[rollout_id].values(),
                                self.required(rollout_id))
        assert reward is not None
        return reward

    def _is_done(self, group_id: str) -> bool:
        members = self._groups[group_id]
        size = self._rollouts[members[0]].group_size
        return len(members) == size and all(m in self._dropped or self.is_ready(m) for m in members)

    def awaited_scores(self) -> dict[str, int]:
        """Scorer name -> buffered rollouts (not dropped) still waiting for its score: what a
        waiting trainer names."""
        waiting: dict[str, int] = {}
        for rollout_id in self._rollouts:
            if rollout_id in self._dropped:
                continue
            for name in self.required(rollout_id).keys() - self._scores.get(rollout_id, {}).keys():
                waiting[name] = waiting.get(name, 0) + 1
        return dict(sorted(waiting.items()))

    def awaited_signals(self) -> dict[str, int]:
        """Teacher name -> buffered rollouts (not dropped) still waiting for its signal."""
        waiting: dict[str, int] = {}
        for rollout_id in self._rollouts:
            if rollout_id in self._dropped:
                continue
            for name in self.required_signals(rollout_id) - self._signals.get(rollout_id, {}).keys():
                waiting[name] = waiting.get(name, 0) + 1
        return dict(sorted(waiting.items()))

    @property
    def num_buffered(self) -> int:
        """Rollouts held (ready, waiting for scores or for the rest of their group, or dropped)."""
        return len(self._rollouts)

    @property
    def num_dropped(self) -> int:
        """Buffered rollouts already dropped, waiting for the rest of their group."""
        return len(self._dropped)

    @property
    def num_orphan_scores(self) -> int:
        """Scores held whose rollout has not arrived (yet)."""
        return sum(1 for rollout_id in self._scores if rollout_id not in self._rollouts)

    def buffered_events(self) -> list[events.Rollout | events.Score | events.Signal]:
        """Everything held, to persist: rollouts, then their scores and signals, and the orphan ones."""
        return [*self._rollouts.values(), *(s for by_scorer in self._scores.values() for s in by_scorer.values()),
                *(s for by_source in self._signals.values() for s in by_source.values())]

    # --- output -----------------------------------------------------------------------

    def take(self, num_groups: int) -> Take | None:
        """The ``num_groups`` oldest done groups with something to train, or None if fewer are done.

        Done groups whose rollouts were all dropped are consumed too (and counted).
        """
        done = [g for g in self._groups if self._is_done(g)]
        trainable = [g for g in done if any(m not in self._dropped for m in self._groups[g])]
        if len(trainable) < num_groups:
            return None
        chosen = trainable[:num_groups]
        take = Take(groups=[])
        for group_id in chosen + [g for g in done if g not in trainable]:
            scored = []
            if group_id not in trainable:
                take.unused += self._groups[group_id]
            for m in sorted(self._groups[group_id], key=self._index):
                if m in self._dropped:
                    take.dropped[m] = self._dropped[m]
                    if m in self._errors:
                        take.errors[m] = self._errors[m]
                else:
                    rollout = self._rollouts[m]
                    scored.append(Scored(rollout, self.reward(m), self.version - rollout.policy_version,
                                         {name: self._scores[m][name].value for name in self.required(m)},
                                         {name: self._signals[m][name] for name in self.required_signals(m)},
                                         self._sequences[m]))
            if scored:
                take.groups.append(scored)
            self._consume(group_id)
        # A step's sums run in one order whatever order its groups arrived in: by their tasks'
        # sampling seeds (a seeded run's task positions), then ids; rollouts by index above.
        take.groups.sort(key=lambda g: (_seed_of(g[0].rollout), g[0].rollout.group_id))
        return take

    def _index(self, rollout_id: str) -> int:
        rollout = self._rollouts.get(rollout_id)
        return rollout.index if rollout is not None else -1

    def _consume(self, group_id: str) -> None:
        for m in self._groups.pop(group_id):
            del self._rollouts[m]
            del self._sequences[m]
            self._scores.pop(m, None)
            self._signals.pop(m, None)
            self._dropped.pop(m, None)
            self._errors.pop(m, None)
            self.consumed.add(m)
