"""An environment's hooks on the interception endpoint: see, rewrite, block or flag each call.

A **request hook** gets each model call's messages and the task row before the model sees them
and returns ``None`` (pass), a new list of messages (the call is sampled on those: redact a
secret, strip an injected instruction), :class:`Block` (the call is refused with the reason,
which the harness gets as the API's error; nothing is sampled) or :class:`Flag` (pass, and mark
the rollout). A **response hook** gets the messages and the sampled answer and returns ``None``
or :class:`Flag`; an answer is what the model sampled, so a hook never rewrites it (the trace's
tokens stay exact).

Flags are counted in the rollout's metrics (``flags.<hook>``, one per flagged call) and the
reward-hacking watch turns a flagged rollout into a ``watch`` score (component ``hook:<name>``),
so ``GET /v1/rollouts?flagged=true`` lists them with the watch's own; each hook's first flag in
a process is logged with its reason.

    def no_test_edits(messages, task):
        if any("tests/" in m.content and m.role == "assistant" for m in messages):
            return Flag("the agent touched the tests")

    Environment(..., request_hooks=[no_test_edits])
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.contract import events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    """Refuse the call; ``reason`` reaches the harness as the error's message."""

    reason: str


@dataclass(frozen=True)
class Flag:
    """Let the call through and mark the rollout, for ``reason``."""

    reason: str


RequestHook = Callable[[list[events.Message], dict[str, Any]], list[events.Message] | Block | Flag | None]
ResponseHook = Callable[[list[events.Message], events.Message, dict[str, Any]], Flag | None]
FLAG_METRIC = "flags."  # a rollout's metric per flagging hook: flags.<hook name>


class Blocked(Exception):
    """A request hook refused the call."""

    def __init__(self, hook: str, reason: str) -> None:
        super().__init__(f"blocked by the environment's hook {hook!r}: {reason}")
        self.hook, self.reason = hook, reason


def hook_name(hook: Callable[..., Any]) -> str:
    return getattr(hook, "__name__", type(hook).__name__)


_logged: set[str] = set()


@dataclass
class CallHooks:
    """The hooks of one rollout and what they flagged."""

    request: Sequence[RequestHook] = ()
    response: Sequence[ResponseHook] = ()
    task: Mapping[str, Any] = field(default_factory=dict)
    flags: dict[str, int] = field(default_factory=dict)  # hook -> calls it flagged

    def __bool__(self) -> bool:
        return bool(self.request or self.response)

    def _flag(self, hook: Callable[..., Any], reason: str) -> None:
        name = hook_name(hook)
        self.flags[name] = self.flags.get(name, 0) + 1
        if name not in _logged:
            _logged.add(name)
            log.warning("the environment's hook %r flags a call: %s; flagged rollouts are in the trace API "
                        "(?flagged=true) and count in metrics as %s%s", name, reason, FLAG_METRIC, name)

    def before(self, messages: list[events.Message]) -> list[events.Message]:
        """The messages the model is given (raises :class:`Blocked`)."""
        for hook in self.request:
            outcome = hook(list(messages), dict(self.task))
            if isinstance(outcome, Block):
                raise Blocked(hook_name(hook), outcome.reason)
            if isinstance(outcome, Flag):
                self._flag(hook, outcome.reason)
            elif isinstance(outcome, list):
                if not all(isinstance(m, events.Message) for m in outcome) or not outcome:
                    raise TypeError(f"request hook {hook_name(hook)!r} returned {outcome!r}: give None, Block, Flag "
                                    "or a non-empty list of flywheel.contract.events.Message")
                messages = outcome
            elif outcome is not None:
                raise TypeError(f"request hook {hook_name(hook)!r} returned a {type(outcome).__name__}: give None, "
                                "Block, Flag or a list of messages")
        return messages

    def after(self, messages: list[events.Message], answer: events.Message) -> None:
        for hook in self.response:
            outcome = hook(list(messages), answer, dict(self.task))
            if isinstance(outcome, Flag):
                self._flag(hook, outcome.reason)
            elif outcome is not None:
                raise TypeError(f"response hook {hook_name(hook)!r} returned a {type(outcome).__name__}: give None "
                                "or Flag (an answer is what the model sampled: it is not rewritten)")

    def metrics(self) -> dict[str, float]:
        return {f"{FLAG_METRIC}{name}": float(n) for name, n in self.flags.items()}


def hook_flags(metrics: Mapping[str, float]) -> list[str]:
    """The hooks that flagged a rollout, from its metrics."""
    return sorted(k.removeprefix(FLAG_METRIC) for k, v in metrics.items() if k.startswith(FLAG_METRIC) and v > 0)
