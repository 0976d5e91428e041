"""Data models of the guess-number environment."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessNumberAction(Action):
    """One guess."""

    guess: int = Field(..., ge=1, le=20, description="Your guess: a whole number from 1 to 20")


class GuessNumberObservation(Observation):
    """What the last guess told."""

    feedback: str = Field(default="", description="higher, lower, correct, or the rules at reset")
    guesses_left: int = Field(default=0, description="Guesses left")
