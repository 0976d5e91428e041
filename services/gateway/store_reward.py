"""A rollout's reward and error as the trace store defines them, in SQL.

A rollout's reward is the one definition every reader uses
(:func:`flywheel.sdk.scoring.rollout_reward`), computed in SQL (:func:`reward_expression`):
the weighted sum of the values of its run's scorers (``run_scorers``, mirrored from the
run's ``RunState.scorers``, or from ``RunState.env_scorers`` those of the rollout's
environment in a run with several; a score of any other scorer counts for nothing), null
until each of them has scored it, when one failed on it, and when the rollout is an error; a
rollout whose scorers are not known counts every score at its own weight. Recording keeps it
current (:mod:`flywheel_gateway.store_recording`), so filters on it run in SQL.

A rollout has an error (:func:`has_error`) when inference marked it ``error`` or gave an error
message, or a scorer failed on it; :func:`shown_error` says why, as the API shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa

from flywheel_gateway import schema as s


def reward_expression() -> sa.ColumnElement[float]:
    """A rollout's reward, :func:`flywheel.sdk.scoring.rollout_reward` in SQL (a test holds
    them equal): where its scorers are known (``run_scorers``: its run's rows of its
    environment, or of every environment, env ''; a run has one kind or the other), the sum of
    weight x value over them, NULL while one of them has no score without an error; elsewhere
    the weighted sum of every score, NULL before the first and when one failed. A rollout of a
    run with rows per environment but none of its own takes that rule too, as one of a run
    without rows does. NULL for an errored rollout either way."""
    r, sc, rs = s.rollouts.c, s.scores.c, s.run_scorers.c
    applies = sa.and_(rs.run == r.run, rs.env.in_([r.env, ""]))  # the rows that make this rollout's reward
    known = sa.exists().where(applies)
    scored = sa.exists().where(sc.rollout_id == r.id, sc.scorer == rs.scorer, sc.error.is_(None))
    unmet = sa.exists().where(applies, sa.not_(scored.correlate_except(s.scores)))
    required = (sa.select(sa.func.sum(rs.weight * sc.value))
                .select_from(s.run_scorers.join(s.scores, sa.and_(sc.scorer == rs.scorer, sc.rollout_id == r.id)))
                .where(applies).scalar_subquery())
    every = sa.select(sa.func.sum(sc.value * sc.weight)).where(sc.rollout_id == r.id).scalar_subquery()
    return sa.case((r.status == "error", sa.null()),
                   (known, sa.case((unmet, sa.null()), else_=required)),
                   (_failed_score(r.id), sa.null()),
                   else_=every)


def _failed_score(rollout_id: sa.ColumnElement[str]) -> sa.Exists:
    sc = s.scores.c
    return sa.exists().where(sc.rollout_id == rollout_id, sc.error.is_not(None))


def has_error() -> sa.ColumnElement[bool]:
    """A rollout has an error: inference marked it ``error`` or gave a message, or a scorer failed on it."""
    c = s.rollouts.c
    return sa.or_(c.status == "error", c.error.is_not(None), _failed_score(c.id))


def shown_error(status: str, error: str | None, scores: Iterable[Mapping[str, Any]]) -> str | None:
    """A rollout's ``error`` as the API shows it: why :func:`has_error` holds (inference's
    message, then each failed scorer's), None where it does not. The filter ``error=true``
    also keeps rollouts a scorer failed on and those inference marked ``error`` without a
    message; the rollout's own message alone would show them as null."""
    whys = [error] if error else []
    whys += [f"scorer {sc['scorer']!r} failed: {sc['error']}" for sc in scores if sc["error"] is not None]
    if not whys and (status == "error" or error is not None):
        whys = ["inference marked the rollout an error without a message"]
    return "; ".join(whys) or None
