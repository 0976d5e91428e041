"""Advantages (known values) and losses (gradient sign, clipping and masking, normalisation);
the run config's variants of advantage, loss and engine agree with the trainer's registries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.contract.config import BY_PATH, ClippedLoss, EnginePart, GroupMeanAdvantage, TrainerConfig, variants
from flywheel_trainer.advantages import ADVANTAGES, group_mean, leave_one_out
from flywheel_trainer.engines import ENGINES, Engine
from flywheel_trainer.join import Tokens
from flywheel_trainer.learner import train_step
from flywheel_trainer.losses import LOSSES


def test_group_mean_subtracts_the_mean_and_optionally_divides_by_the_std() -> None:
    assert group_mean([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_mean([1.0, 0.0, 0.0, 1.0], normalize_std=True) == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_mean([0.7, 0.7, 0.7], normalize_std=True) == pytest.approx([0.0] * 3, abs=1e-6)  # no NaN
    assert group_mean([3.0]) == [0.0]


def test_leave_one_out_uses_the_mean_of_the_others() -> None:
    assert leave_one_out([1.0, 2.0, 3.0]) == pytest.approx([-1.5, 0.0, 1.5])
    assert leave_one_out([1.0, 0.0]) == [1.0, -1.0]
    assert leave_one_out([5.0]) == [0.0]
    # n/(n-1) times the group-mean advantage
    rewards = [0.2, 0.9, 0.4, 0.5]
    assert leave_one_out(rewards) == pytest.approx([a * 4 / 3 for a in group_mean(rewards)])
    assert set(ADVANTAGES) == {"group_mean", "leave_one_out"}


def grad_of(loss_name: str, ratio: float, advantage: float, eps: float = 0.2) -> tuple[float, bool]:
    """d(loss)/d(logprob) at one token whose ratio to the sampler is ``ratio``, and whether it was flagged."""
    old = torch.tensor([-1.0])
    logprob = (old + torch.log(torch.tensor([ratio]))).requires_grad_()
    loss, flagged = LOSSES[loss_name](logprob, old, torch.tensor([advantage]), eps)
    loss.sum().backward()
    assert logprob.grad is not None
    return float(logprob.grad[0]), bool(flagged[0])


@pytest.mark.parametrize("loss_name", ["clipped", "masked"])
def test_on_policy_the_gradient_raises_good_tokens_and_lowers_bad_ones(loss_name: str) -> None:
    # Gradient descent moves the logprob against the gradient.
    assert grad_of(loss_name, 1.0, advantage=2.0) == (pytest.approx(-2.0), False)
    assert grad_of(loss_name, 1.0, advantage=-2.0) == (pytest.approx(2.0), False)


def test_clipped_stops_a_token_once_its_ratio_moved_eps_the_way_its_advantage_wants() -> None:
    assert grad_of("clipped", 1.5, advantage=1.0) == (0.0, True)  # already raised enough
    assert grad_of("clipped", 0.5, advantage=-1.0) == (0.0, True)  # already lowered enough
    # Moved the wrong way: the gradient stays, importance-weighted.
    assert grad_of("clipped", 0.5, advantage=1.0) == (pytest.approx(-0.5), False)
    assert grad_of("clipped", 1.5, advantage=-1.0) == (pytest.approx(1.5), False)
    assert grad_of("clipped", 1.1, advantage=1.0) == (pytest.approx(-1.1), False)


def test_masked_drops_every_token_outside_the_trust_region_whatever_its_advantage() -> None:
    for ratio in (0.5, 1.5):
        for advantage in (1.0, -1.0):
            assert grad_of("masked", ratio, advantage) == (0.0, True)
    assert grad_of("masked", 1.1, advantage=1.0) == (pytest.approx(-1.1), False)
    assert grad_of("masked", 0.9, advantage=-1.0) == (pytest.approx(0.9), False)


class RecordingEngine:
    """A hand-written engine: plain backward, and a step that records the gradients instead of applying them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = self.module = model
        self.device = torch.device("cpu")
        self.grads: list[torch.Tensor] = []

    def autocast(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        self.grads = [p.grad.clone() for p in self.module.parameters() if p.grad is not None]
        self.module.zero_grad(set_to_none=True)
        return 0.0

    # The rest of the Engine interface: train_step never calls it.
    def weights(self) -> bytes:
        raise NotImplementedError

    def save(self, folder: Path) -> None:
        raise NotImplementedError

    def load(self, folder: Path) -> None:
        raise NotImplementedError


class Bigram(torch.nn.Module):
    """The smallest causal LM: next-token logits from the current token only."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        return type("Out", (), {"logits": self.table(input_ids)})()


def sequences() -> tuple[list[Tokens], list[float]]:
    seqs = [
        Tokens([1, 2, 3, 4, 5], [0.0, 0.0, -2.0, -2.1, -1.9], [False, False, True, True, True]),
        Tokens([1, 6, 7], [0.0, 0.0, -2.5], [False, False, True]),
        Tokens([2, 3, 8, 9, 10, 11], [0.0, 0.0, 0.0, -2.2, -2.4, -2.6], [False, False, False, True, True, True]),
    ]
    return seqs, [1.0, -0.5, 0.25]


def policy_gradient(logprobs: torch.Tensor, batch: object, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return LOSSES["clipped"](
        logprobs, batch.old_logprobs, batch.advantages[:, None], 0.2)  # type: ignore[attr-defined]  # gets a Batch


def test_the_loss_is_normalised_by_loss_tokens_in_the_whole_step_however_it_is_cut() -> None:
    seqs, advantages = sequences()
    engine = RecordingEngine(Bigram())
    ones = train_step(engine, seqs, advantages, 0, 2, [1.0] * 3,
                      lambda lp, b, indices: (torch.ones_like(lp) + 0 * lp, torch.zeros_like(b.loss_mask)))
    assert ones["loss"] == pytest.approx(1.0) and ones["num_loss_tokens"] == 7  # 3 + 1 + 3, padding excluded
    whole = train_step(engine, seqs, advantages, 0, 3, [1.0] * 3, policy_gradient)
    whole_grads = engine.grads
    one_by_one = train_step(engine, seqs, advantages, 0, 1, [1.0] * 3, policy_gradient)
    assert one_by_one["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole_grads, engine.grads, strict=True))


@pytest.mark.parametrize(("field", "registry"), [("advantage", ADVANTAGES), ("loss", LOSSES), ("engine", ENGINES)])
def test_the_config_variants_and_the_trainer_registries_agree(field: str, registry: dict) -> None:
    """Every built-in variant the run config describes has its registry entry, and the entry takes
    what the trainer passes plus the variant's own fields; the registry has nothing else."""
    parts = variants(TrainerConfig.model_fields[field])
    assert set(parts) - {BY_PATH} == set(registry)
    for name, variant in parts.items():
        if name != BY_PATH:
            variant.check_call(registry[name], variant.model_validate({}).kwargs())


def test_a_users_engine_has_the_methods_of_the_trainers_engine() -> None:
    methods = {name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")}
    assert set(EnginePart.METHODS) == methods


def test_a_part_binds_its_fields_as_keyword_arguments() -> None:
    assert GroupMeanAdvantage(normalize_std=True).bind(ADVANTAGES)([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)
    old = torch.tensor([-1.0])
    logprob = old + torch.log(torch.tensor([1.4]))
    assert bool(ClippedLoss(clip_eps=0.5).bind(LOSSES)(logprob, old, torch.tensor([1.0]))[1][0]) is False
    assert bool(ClippedLoss(clip_eps=0.2).bind(LOSSES)(logprob, old, torch.tensor([1.0]))[1][0]) is True
    with pytest.raises(ValueError, match=r"trainer\.loss: type='clipped' is not available in this service; "
                                         r"it has masked"):
        ClippedLoss().bind({"masked": LOSSES["masked"]})


def test_each_environment_trains_with_its_own_advantage_and_loss() -> None:
    from flywheel.contract.config import RunConfig
    from flywheel_trainer.join import Scored
    from flywheel_trainer.learner import rl_step
    from tests.unit.test_trainer_join import make_rollout

    cfg = RunConfig.parse({"run": "r", "group_size": 2, "trainer": {"batch_size": 4}, "envs": [
        {"id": "a", "loss": {"type": "masked", "clip_eps": 0.01}, "advantage": "leave_one_out"}, {"id": "b"}]})
    groups = [[Scored(make_rollout(f"{env}{i}", f"g-{env}", env=env, index=i, completion=[5 + i, 6 + i]), reward, 0)
               for i, reward in enumerate((1.0, 0.0))] for env in ("a", "b")]
    envs = {env.id: env for env in cfg.environments}

    def grads(micro_batch_size: int, by_env: dict | None) -> list[torch.Tensor]:
        engine = RecordingEngine(Bigram())
        rl_step(engine, groups, 0, cfg, micro_batch_size, by_env)
        return engine.grads

    def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return all(torch.allclose(a, b, atol=1e-6) for a, b in zip(x, y, strict=True))

    # A micro-batch holding both environments' sequences computes each with its own loss: the
    # same gradient as one sequence at a time (each micro-batch of one environment).
    mixed = grads(4, envs)
    assert same(mixed, grads(1, envs))
    assert not same(mixed, grads(4, None))  # without them, both take the run's (clipped, group mean)
    only_b_own = {"a": envs["b"], "b": envs["b"]}  # a trained as b is: the run's parts
    assert same(grads(4, only_b_own), grads(4, None))
