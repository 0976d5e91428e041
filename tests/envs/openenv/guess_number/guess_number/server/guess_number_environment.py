"""The guess-number environment: a secret number from 1 to 20 (drawn from the reset's seed), five
guesses, each answered higher or lower; reward 1 for the guess that finds it, 0 otherwise."""

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from guess_number.models import GuessNumberAction, GuessNumberObservation

MAX_GUESSES = 5


class GuessNumberEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessNumberObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, 20)
        return GuessNumberObservation(feedback="I picked a number from 1 to 20. Guess it.",
                                      guesses_left=MAX_GUESSES, done=False, reward=0.0)

    def step(self, action: GuessNumberAction, timeout_s=None, **kwargs) -> GuessNumberObservation:  # type: ignore[override]
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.guess == self._secret:
            return GuessNumberObservation(feedback="correct", guesses_left=left, done=True, reward=1.0)
        feedback = "higher" if action.guess < self._secret else "lower"
        return GuessNumberObservation(feedback=feedback, guesses_left=left, done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
