"""The reward-hacking watch: detectors beside the scorer, on every run.

RL finds an environment's holes before a person does: the policy learns what the reward pays
for, which is not always what its author meant. The watch keeps a window of each run's recent
scored rollouts and flags a rollout when it looks like one of the known ways a reward is
gamed:

- ``divergence``: the trained reward and a check the run does not train on (a metric: a reward
  of weight 0, such as a judge or a held-out test) part ways (how much more a rollout is paid
  than checked grows across the window, and the check falls), and this rollout is paid well and
  checked badly. Judged twice: over the window of recent rollouts (a sudden turn), and over the
  run's last ``history_versions`` policy versions, kept as sums per version (a drift over many
  steps, which a window of a few steps' rollouts cannot see).
- ``length`` / ``repetition``: reward tracks completion length, or how much a completion repeats
  itself (correlation over the window), and this rollout is long (repetitive) and paid at least
  the window's median reward.
- ``identical``: the same completion answers several different tasks and is paid for it.
- ``saturated``: a reward component is pinned at its maximum while another part of the reward
  (or a metric) falls.

A flag is a :class:`flywheel.contract.events.Score` from the scorer ``watch`` (value: how many
detectors fired, components: which; weight 0, so it never changes a reward), published with the
rollout's own scores: the trace API filters on it (``?flagged=true``) and the trainer counts it
in the step's metrics (``flagged``). Each detector's first flag in a run is logged with its
reason, naming the rollout. Detectors look at the rollout and its per-rollout scores only (group
rewards arrive later), and they need a window of ``min_window`` rollouts before they judge a
trend.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import operator
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from flywheel.contract import events

WATCH = events.WATCH_SCORER  # the scorer name of a flag
T = TypeVar("T")


@dataclass(frozen=True)
class Seen:
    """What the watch keeps of one scored rollout."""

    task: str  # the task id
    version: int  # the policy version that sampled it
    digest: bytes  # of the completion, whitespace-normalized (the window keeps no whole texts)
    preview: str  # its first characters, for a flag's reason
    length: int  # completion characters
    repetition: float  # share of its word trigrams that repeat an earlier one
    reward: float  # the weighted sum of the trained rewards (weight > 0)
    checks: dict[str, float]  # metrics (weight 0)
    parts: dict[str, float]  # each trained reward and component, by name


def repetition(text: str) -> float:
    """The share of word trigrams that already occurred earlier in ``text``."""
    words = text.split()
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    if len(grams) < 4:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def seen_of(rollout: events.Rollout, completion: str, scores: Iterable[events.Score]) -> Seen:
    reward, checks, parts = 0.0, {}, {}
    for s in scores:
        if s.error is not None or s.scorer == WATCH:
            continue
        if s.weight == 0:
            checks[s.scorer] = s.value
            continue
        reward += s.weight * s.value
        parts[s.scorer] = s.value
        for name, value in s.components.items():
            parts[f"{s.scorer}.{name}"] = value
    text = " ".join(completion.split())
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return Seen(rollout.task_id, rollout.policy_version, digest, text[:60], len(text), repetition(text), reward,
                checks, parts)


RECENT = 32  # rollouts that make "now" in a trend, once the window holds twice as many


def _split(values: list[float]) -> tuple[list[float], list[float]]:
    """(earlier, recent): the last ``RECENT`` values against the rest, or halves while few."""
    cut = len(values) - RECENT if len(values) >= 2 * RECENT else len(values) // 2
    return values[:cut], values[cut:]


def _halves(values: list[float]) -> tuple[float, float]:
    """The mean of the earlier values and of the recent ones (:func:`_split`)."""
    earlier, recent = _split(values)
    return statistics.fmean(earlier), statistics.fmean(recent)


def _median(ordered: list[float]) -> float:
    """The median of sorted values, as statistics.median gives it (the mean of the middle two when even)."""
    i = len(ordered) // 2
    return ordered[i] if len(ordered) % 2 else (ordered[i - 1] + ordered[i]) / 2


def _variance(values: list[float], mean: float) -> float:
    """The population variance in floats (statistics.pvariance is exact, in fractions: far slower)."""
    deviations = [v - mean for v in values]
    return math.fsum(map(operator.mul, deviations, deviations)) / len(values)


def _z(values: list[float]) -> float:
    """How many standard errors the recent values' mean lies above the earlier ones'."""
    a, b = _split(values)
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    spread = _variance(a, mean_a) / len(a) + _variance(b, mean_b) / len(b)
    gap = mean_b - mean_a
    return gap / spread ** 0.5 if spread > 0 else (math.inf if gap > 0 else -math.inf if gap < 0 else 0.0)


def _correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation (0 where either side is constant), with the products summed in C
    (``map(operator.mul, ...)``): statistics.correlation's generators cost more than the rest of
    a rollout's watch."""
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return 0.0
    mean_x, mean_y = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    dx, dy = [x - mean_x for x in xs], [y - mean_y for y in ys]
    return math.fsum(map(operator.mul, dx, dy)) / math.sqrt(math.fsum(map(operator.mul, dx, dx))
                                                            * math.fsum(map(operator.mul, dy, dy)))


@dataclass
class CheckSums:
    """Sums over one policy version's rollouts that have a check: of the check, its square, and
    their rewards; its largest value."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    rewards: float = 0.0
    top: float = -math.inf

    def add(self, value: float, reward: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value
        self.rewards += reward
        self.top = max(self.top, value)

    @staticmethod
    def of(parts: Iterable[CheckSums]) -> CheckSums:
        whole = CheckSums()
        for p in parts:
            whole.n, whole.total, whole.squares = whole.n + p.n, whole.total + p.total, whole.squares + p.squares
            whole.rewards, whole.top = whole.rewards + p.rewards, max(whole.top, p.top)
        return whole

    @property
    def mean(self) -> float:
        return self.total / self.n

    @property
    def variance(self) -> float:
        return max(self.squares / self.n - self.mean ** 2, 0.0)


@dataclass
class VersionSums:
    """One policy version's scored rollouts, as sums: the run's long memory for trends."""

    n: int = 0
    top_reward: float = -math.inf
    checks: dict[str, CheckSums] = field(default_factory=dict)


def _push(columns: dict[str, deque[T]], name: str, value: T) -> None:
    columns.setdefault(name, deque()).append(value)


def _pop(columns: dict[str, deque[T]], name: str) -> None:
    """Drop ``name``'s oldest value: the window's oldest rollout is its oldest one with that name."""
    column = columns[name]
    column.popleft()
    if not column:
        del columns[name]


@dataclass
class RunWindow:
    """One run's recent scored rollouts, its last policy versions as sums, and which detectors
    already spoke up. The window is also kept as columns (each value of its rollouts in order,
    a named one over the rollouts that have it), so a detector reads a column, not every rollout."""

    size: int
    history_versions: int = 64
    items: deque[Seen] = field(default_factory=deque)
    versions: OrderedDict[int, VersionSums] = field(default_factory=OrderedDict)
    logged: set[str] = field(default_factory=set)
    rewards: deque[float] = field(default_factory=deque)
    lengths: deque[float] = field(default_factory=deque)
    # The same two, sorted, kept as rollouts enter and leave: their medians without a sort a rollout.
    sorted_rewards: list[float] = field(default_factory=list)
    sorted_lengths: list[float] = field(default_factory=list)
    repetitions: deque[float] = field(default_factory=deque)
    check_values: dict[str, deque[float]] = field(default_factory=dict)  # check -> its values
    check_rewards: dict[str, deque[float]] = field(default_factory=dict)  # check -> those rollouts' rewards
    parts: dict[str, deque[float]] = field(default_factory=dict)  # trained reward or component -> values
    named: dict[str, deque[float]] = field(default_factory=dict)  # parts and checks (a check's name wins)
    # completion digest -> task -> how many of the window's rollouts: "identical" without a scan
    answers: dict[bytes, Counter[str]] = field(default_factory=dict)
    # The largest reward, and each check's largest value, over the remembered versions: kept as
    # rollouts come, counted again only when a version is forgotten (the drift check reads them
    # for every rollout).
    top_reward: float = -math.inf
    check_tops: dict[str, float] = field(default_factory=dict)

    def add(self, seen: Seen) -> None:
        self.items.append(seen)
        self.rewards.append(seen.reward)
        self.lengths.append(float(seen.length))
        bisect.insort(self.sorted_rewards, seen.reward)
        bisect.insort(self.sorted_lengths, float(seen.length))
        self.repetitions.append(seen.repetition)
        for name, value in seen.checks.items():
            _push(self.check_values, name, value)
            _push(self.check_rewards, name, seen.reward)
        for name, value in seen.parts.items():
            _push(self.parts, name, value)
        for name, value in (seen.parts | seen.checks).items():
            _push(self.named, name, value)
        self.answers.setdefault(seen.digest, Counter())[seen.task] += 1
        while len(self.items) > self.size:
            self._evict(self.items.popleft())
        sums = self.versions.get(seen.version)
        if sums is None:
            sums = self.versions[seen.version] = VersionSums()
            if len(self.versions) > self.history_versions:
                while len(self.versions) > self.history_versions:
                    self.versions.popitem(last=False)
                self._count_tops()
        sums.n += 1
        sums.top_reward = max(sums.top_reward, seen.reward)
        self.top_reward = max(self.top_reward, seen.reward)
        for name, value in seen.checks.items():
            sums.checks.setdefault(name, CheckSums()).add(value, seen.reward)
            self.check_tops[name] = max(self.check_tops.get(name, -math.inf), value)

    def _count_tops(self) -> None:
        self.top_reward = max((v.top_reward for v in self.versions.values()), default=-math.inf)
        self.check_tops = {}
        for version in self.versions.values():
            for name, sums in version.checks.items():
                self.check_tops[name] = max(self.check_tops.get(name, -math.inf), sums.top)

    def _evict(self, gone: Seen) -> None:
        for column in (self.rewards, self.lengths, self.repetitions):
            column.popleft()
        for ordered, value in ((self.sorted_rewards, gone.reward), (self.sorted_lengths, float(gone.length))):
            del ordered[bisect.bisect_left(ordered, value)]
        for name in gone.checks:
            _pop(self.check_values, name)
            _pop(self.check_rewards, name)
        for name in gone.parts:
            _pop(self.parts, name)
        for name in gone.parts | gone.checks:
            _pop(self.named, name)
        tasks = self.answers[gone.digest]
        tasks[gone.task] -= 1
        if not tasks[gone.task]:
            del tasks[gone.task]
            if not tasks:
                del self.answers[gone.digest]


@dataclass
class Watch:
    """The detectors, with their thresholds (see the module's docstring)."""

    window: int = 256  # rollouts kept per run
    min_window: int = 32  # rollouts before a trend is judged
    trend: float = 0.15  # how far a mean must move from the earlier rollouts to the recent ones to be a trend
    min_z: float = 3.0  # ... and how many standard errors, where noise could move it as far
    min_identical_tasks: int = 3  # distinct tasks answered by one completion
    min_identical_chars: int = 8  # shorter completions (a digit, "yes") are allowed to repeat
    length_correlation: float = 0.8
    max_repetition: float = 0.5  # share of repeated word trigrams
    repetition_correlation: float = 0.5
    saturated: float = 0.99
    max_runs: int = 64  # runs watched at once: the one not seen longest is forgotten
    history_versions: int = 64  # policy versions a run's drift is judged over
    runs: OrderedDict[str, RunWindow] = field(default_factory=OrderedDict)

    def see(self, rollout: events.Rollout, completion: str, scores: Iterable[events.Score]
            ) -> dict[str, str]:
        """Add a scored rollout to its run's window; returns the detectors that flag it, each with why."""
        run = self.runs.setdefault(rollout.run, RunWindow(self.window, self.history_versions))
        self.runs.move_to_end(rollout.run)
        while len(self.runs) > self.max_runs:
            self.runs.popitem(last=False)
        seen = seen_of(rollout, completion, scores)
        run.add(seen)
        flags: dict[str, str] = {}
        rewards = list(run.rewards)
        self._identical(run, rewards, seen, flags)
        if len(rewards) >= self.min_window:
            self._repetition(run, rewards, seen, flags)
            self._divergence(run, max(rewards), seen, flags)
            self._length(run, rewards, seen, flags)
        if "divergence" not in flags:
            self._drift(run, seen, flags)
            self._saturated(run, seen, flags)
        return flags

    def first_time(self, run: str, detector: str) -> bool:
        """Whether ``detector`` flags ``run`` for the first time (its first flag is logged)."""
        window = self.runs[run]
        first = detector not in window.logged
        window.logged.add(detector)
        return first

    def _identical(self, run: RunWindow, rewards: list[float], seen: Seen, flags: dict[str, str]) -> None:
        if seen.length < self.min_identical_chars or seen.reward <= 0:
            return
        tasks = run.answers.get(seen.digest, Counter())  # absent only where the window holds nothing
        if len(tasks) >= self.min_identical_tasks and seen.reward >= _median(run.sorted_rewards):
            flags["identical"] = (f"the same completion ({seen.preview!r}) answers {len(tasks)} different tasks "
                                  f"in the run's recent rollouts, paid {seen.reward:.3g}")

    def _repetition(self, run: RunWindow, rewards: list[float], seen: Seen, flags: dict[str, str]) -> None:
        if seen.repetition < self.max_repetition:
            return
        r = _correlation(list(run.repetitions), rewards)
        if r >= self.repetition_correlation and seen.reward >= _median(run.sorted_rewards):
            flags["repetition"] = (f"{seen.repetition:.0%} of its word trigrams repeat, reward follows repetition "
                                   f"(correlation {r:.2f} over {len(rewards)} rollouts), and it is paid "
                                   f"{seen.reward:.3g}")

    def _divergence(self, run: RunWindow, top: float, seen: Seen, flags: dict[str, str]) -> None:
        """How far a rollout's reward (relative to the window's best) exceeds its check's (the
        same) is their disagreement; the watch flags when it grows from the earlier rollouts to
        the recent ones, the check falls, and this rollout disagrees: paid well, checked badly."""
        if top <= 0:
            return
        for check in seen.checks:
            values, paid = list(run.check_values[check]), list(run.check_rewards[check])
            best = max(values)
            if len(values) < self.min_window or best <= 0:
                continue
            mine = seen.reward / top - seen.checks[check] / best
            if mine < 0.5:  # the cheapest condition first: most rollouts are not paid well and checked badly
                continue
            was, now = _halves([r / top - c / best for r, c in zip(paid, values, strict=True)])
            if now - was < self.trend:
                continue
            rewards, checks = _halves(paid), _halves(values)
            # A check steady while the reward rises is no sign: it must fall, beyond its noise.
            falling = checks[0] - checks[1] >= self.trend / 2 and _z(values) <= -self.min_z
            if falling:
                flags["divergence"] = (f"the reward and the metric {check!r} part ways: reward "
                                       f"{rewards[0]:.3g} -> {rewards[1]:.3g}, {check} {checks[0]:.3g} -> "
                                       f"{checks[1]:.3g} from the earlier to the last of {len(values)} rollouts; "
                                       f"this one is paid {seen.reward:.3g} with {check} {seen.checks[check]:.3g}")
                return

    def _drift(self, run: RunWindow, seen: Seen, flags: dict[str, str]) -> None:
        """Divergence over policy versions: the first half of the run's remembered versions
        against its latest ones (those holding the last ``RECENT`` rollouts), from sums."""
        top = run.top_reward
        if top <= 0:
            return
        # The cheapest condition first: most rollouts are not paid well and checked badly.
        suspect = [(check, best) for check, best in ((c, run.check_tops.get(c, 0.0)) for c in seen.checks)
                   if best > 0 and seen.reward / top - seen.checks[check] / best >= 0.5]
        if not suspect:
            return
        versions = list(run.versions.values())
        recent: list[VersionSums] = []
        while versions and sum(v.n for v in recent) < RECENT:
            recent.append(versions.pop())
        earlier = versions[:len(versions) // 2]
        if len(earlier) < 2 or sum(v.n for v in earlier) < self.min_window:
            return
        for check, best in suspect:
            was = CheckSums.of(v.checks[check] for v in earlier if check in v.checks)
            now = CheckSums.of(v.checks[check] for v in recent if check in v.checks)
            if was.n < self.min_window or now.n < RECENT // 2:
                continue
            grew = (now.rewards / now.n / top - now.mean / best) - (was.rewards / was.n / top - was.mean / best)
            spread = (was.variance / was.n + now.variance / now.n) ** 0.5
            z = (now.mean - was.mean) / spread if spread > 0 else -math.inf if now.mean < was.mean else 0.0
            falling = was.mean - now.mean >= self.trend / 2 and z <= -self.min_z
            if grew >= self.trend and falling:
                first, last = next(iter(run.versions)), next(reversed(run.versions))
                flags["divergence"] = (f"the reward and the metric {check!r} part ways over policy versions "
                                       f"{first}..{last}: reward {was.rewards / was.n:.3g} -> "
                                       f"{now.rewards / now.n:.3g}, {check} {was.mean:.3g} -> {now.mean:.3g} "
                                       f"from the earlier versions to the latest; this one is paid "
                                       f"{seen.reward:.3g} with {check} {seen.checks[check]:.3g}")
                return

    def _length(self, run: RunWindow, rewards: list[float], seen: Seen, flags: dict[str, str]) -> None:
        if seen.length < _median(run.sorted_lengths) or seen.reward < _median(run.sorted_rewards):
            return  # the medians first: the correlation is the costly part
        r = _correlation(list(run.lengths), rewards)
        if r >= self.length_correlation:
            flags["length"] = (f"reward follows completion length (correlation {r:.2f} over {len(rewards)} rollouts); "
                               f"this one is {seen.length} characters")

    def _saturated(self, run: RunWindow, seen: Seen, flags: dict[str, str]) -> None:
        for name, value in seen.parts.items():
            if value < self.saturated:
                continue
            values = list(run.parts[name])
            if len(values) < self.min_window or _halves(values)[1] < self.saturated:
                continue
            for other in {**seen.parts, **seen.checks}:
                if other == name or other.startswith(f"{name}.") or name.startswith(f"{other}."):
                    continue
                others = list(run.named[other])
                if len(others) < self.min_window:
                    continue
                was, now = _halves(others)
                if was - now >= self.trend and _z(others) <= -self.min_z:
                    flags["saturated"] = (f"{name!r} is pinned at {value:.3g} while {other!r} fell "
                                          f"{was:.3g} -> {now:.3g}")
                    return


def flag_score(rollout: events.Rollout, flags: Mapping[str, str]) -> events.Score:
    """The Score that marks ``rollout`` flagged by ``flags`` (weight 0: it never changes a reward)."""
    return events.Score(run=rollout.run, env=rollout.env, rollout_id=rollout.id, group_id=rollout.group_id,
                        scorer=WATCH, value=float(len(flags)), weight=0.0,
                        components={name: 1.0 for name in sorted(flags)})
