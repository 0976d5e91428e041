"""Advantages (known values) and losses (gradient sign, clipping and masking, normalisation);
the run config's variants of advantage, loss and engine agree with the trainer's registries."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from flywheel.contract import events
from flywheel.contract.config import BY_PATH, ClippedLoss, EnginePart, GroupMeanAdvantage, TrainerConfig, variants
from flywheel_trainer.advantages import ADVANTAGES, group_mean, leave_one_out
from flywheel_trainer.engines import ENGINES, Engine
from flywheel_trainer.join import Tokens
from flywheel_trainer.learner import SFTRows, train_step
from flywheel_trainer.losses import LOSSES, cispo, gspo, ratio_clipped


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
    assert set(ADVANTAGES) == {"group_mean", "leave_one_out", "opd"}


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


def test_the_apis_ppo_takes_the_ratios_bounds_themselves() -> None:
    logprob = torch.log(torch.tensor([0.7, 1.3, 1.0])).requires_grad_()
    loss, held = ratio_clipped(torch.exp(logprob), torch.tensor([-1.0, 1.0, 1.0]), 0.8, 1.2)
    loss.sum().backward()
    assert held.tolist() == [True, True, False]  # moved past a bound the way its advantage wants
    assert logprob.grad is not None and logprob.grad.tolist() == pytest.approx([0.0, 0.0, -1.0])


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient() -> None:
    old = torch.zeros(3)
    logprob = torch.log(torch.tensor([0.5, 1.5, 1.1])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -2.0])
    loss, held = cispo(logprob, old, advantages, 0.8, 1.2)
    loss.sum().backward()
    # d/dlogprob of -sg(w) * A * logprob is -w * A, w the clipped ratio: never 0 where A is not.
    assert logprob.grad is not None and logprob.grad.tolist() == pytest.approx([-0.8, -1.2, 2.2])
    assert held.tolist() == [True, True, False]


def test_gspo_gives_a_datum_one_ratio_the_geometric_mean_over_its_advantaged_tokens() -> None:
    old = torch.tensor([0.0, -1.0, -1.0])
    # Token ratios 1 (a prompt position: advantage 0), e^0.1 and e^-0.1: the sequence's is 1.
    logprob = torch.tensor([0.0, -0.9, -1.1], requires_grad=True)
    advantages = torch.tensor([0.0, 1.0, 1.0])
    loss, held = gspo(logprob, old, advantages, 0.8, 1.2, (advantages != 0).float())
    loss.sum().backward()
    assert logprob.grad is not None and logprob.grad.tolist() == pytest.approx([0.0, -1.0, -1.0])
    assert not held.any()
    # Past the bound the way the advantage wants: the whole datum stops (the ratio is one).
    far = torch.tensor([0.0, -0.5, -0.5], requires_grad=True)  # sequence ratio e^0.5 > 1.2
    loss, held = gspo(far, old, advantages, 0.8, 1.2, (advantages != 0).float())
    loss.sum().backward()
    assert far.grad is not None and far.grad.tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert held.tolist() == [False, True, True]


class RecordingEngine:
    """A hand-written engine: plain backward, and a step that records the gradients instead of applying them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = self.module = model
        self.device = torch.device("cpu")
        self.same_graph_on_every_rank = False
        self.grads: list[torch.Tensor] = []

    def autocast(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def idle_backward(self) -> None:
        raise AssertionError("one rank never makes an idle pass")

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


def echo_sequences() -> list[Tokens]:
    """A prompt, an answer (sampled), the environment's turn, another answer; the second row has no environment turn."""
    return [
        Tokens([1, 2, 3, 4, 5, 6], [0.0, 0.0, -2.0, 0.0, 0.0, -2.1], [False, False, True, False, False, True],
               env_mask=[False, False, False, True, True, False]),
        Tokens([1, 7, 8], [0.0, 0.0, -2.5], [False, False, True], env_mask=[False, False, False]),
    ]


def no_rl(logprobs: torch.Tensor, batch: object, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return 0 * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)


def test_echo_is_cross_entropy_on_the_environments_tokens_only_beside_the_rl_loss() -> None:
    seqs = echo_sequences()
    engine = RecordingEngine(Bigram())
    figures = train_step(engine, seqs, [0.0, 0.0], 0, 2, [1.0, 1.0], no_rl, echo_weights=[0.5, 0.5])
    echo_grads = engine.grads
    # By hand: the mean negative log-likelihood of the environment's tokens (4 after 3, 5 after 4), halved.
    model = Bigram()
    logprobs = torch.log_softmax(model.table(torch.tensor([3, 4])), dim=-1)
    expected = -(logprobs[0, 4] + logprobs[1, 5]) / 2
    assert figures["num_env_tokens"] == 2 and figures["echo_loss"] == pytest.approx(expected.item(), abs=1e-6)
    (0.5 * expected).backward()
    assert torch.allclose(echo_grads[0], model.table.weight.grad, atol=1e-6)  # type: ignore[arg-type]
    # Only the rows that predict an environment token move: not the prompt's, not the answers'.
    moved = {int(i) for i in echo_grads[0].abs().sum(-1).nonzero()}
    assert moved == {3, 4}
    # Cut into micro-batches of one: the same gradient (normalised over the step's environment tokens).
    train_step(engine, seqs, [0.0, 0.0], 0, 1, [1.0, 1.0], no_rl, echo_weights=[0.5, 0.5])
    assert torch.allclose(engine.grads[0], echo_grads[0], atol=1e-6)
    # The RL loss goes on as before beside it; weight 0 (or none) is the RL step alone.
    both = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient, echo_weights=[0.5, 0.5])
    rl_and_echo = engine.grads[0]
    rl = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient)
    assert torch.allclose(rl_and_echo, engine.grads[0] + echo_grads[0], atol=1e-6)
    assert both["loss"] == pytest.approx(rl["loss"] + 0.5 * expected.item(), abs=1e-6)
    train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient, echo_weights=[0.0, 0.0])
    assert torch.allclose(engine.grads[0], rl_and_echo - echo_grads[0], atol=1e-6)


def test_an_sft_term_adds_its_rows_weighted_cross_entropy_to_the_rl_steps_gradient() -> None:
    seqs = echo_sequences()
    # Two examples: answers 9 after 8 (one token), then 10 and 11 after 9 and 10 (two), weights 0.5 and 2.
    rows = SFTRows([Tokens([1, 8, 9], [0.0] * 3, [False, False, True]),
                    Tokens([1, 9, 10, 11], [0.0] * 4, [False, False, True, True])], [0.5, 2.0])
    engine = RecordingEngine(Bigram())
    figures = train_step(engine, seqs, [0.0, 0.0], 0, 2, [1.0, 1.0], no_rl, sft_rows=rows)
    term_grads = engine.grads
    # By hand: each answer token's negative log-likelihood times its row's weight, over the term's 3 tokens.
    model = Bigram()
    logprobs = torch.log_softmax(model.table(torch.tensor([8, 9, 10])), dim=-1)
    nll = -torch.stack([logprobs[0, 9], logprobs[1, 10], logprobs[2, 11]])
    (0.5 * nll[0] + 2.0 * nll[1:].sum()).div(3).backward()
    assert figures["num_sft_tokens"] == 3 and figures["sft_term_loss"] == pytest.approx(nll.mean().item(), abs=1e-6)
    assert torch.allclose(term_grads[0], model.table.weight.grad, atol=1e-6)  # type: ignore[arg-type]
    # Cut into micro-batches of one: the same gradient.
    train_step(engine, seqs, [0.0, 0.0], 0, 1, [1.0, 1.0], no_rl, sft_rows=rows)
    assert torch.allclose(engine.grads[0], term_grads[0], atol=1e-6)
    # Beside the RL loss, in the same step: the two gradients add up.
    both = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient, sft_rows=rows)
    together = engine.grads[0]
    rl = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient)
    assert torch.allclose(together, engine.grads[0] + term_grads[0], atol=1e-6)
    assert both["loss"] == pytest.approx(rl["loss"] + figures["loss"], abs=1e-6)
    assert "sft_term_loss" not in rl


def test_a_step_without_environment_tokens_trains_its_rl_loss_alone() -> None:
    seqs = [Tokens(s.token_ids, s.logprobs, s.loss_mask, env_mask=[False] * len(s.token_ids)) for s in echo_sequences()]
    engine = RecordingEngine(Bigram())
    figures = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient, echo_weights=[0.5, 0.5])
    echoed = engine.grads[0]
    rl = train_step(engine, seqs, [1.0, -1.0], 0, 2, [1.0, 1.0], policy_gradient)
    assert figures["num_env_tokens"] == 0 and figures["echo_loss"] == 0.0 and figures["loss"] == rl["loss"]
    assert torch.equal(echoed, engine.grads[0])


def test_echo_predicts_the_environment_at_temperature_one_whatever_the_answers_were_sampled_at() -> None:
    seqs = echo_sequences()
    engine = RecordingEngine(Bigram())
    cold = train_step(engine, seqs, [0.0, 0.0], 0, 2, [0.5, 0.5], no_rl, echo_weights=[1.0, 1.0])
    warm = train_step(engine, seqs, [0.0, 0.0], 0, 2, [1.0, 1.0], no_rl, echo_weights=[1.0, 1.0])
    assert cold["echo_loss"] == pytest.approx(warm["echo_loss"], abs=1e-6)


@pytest.mark.parametrize(("field", "registry"), [("advantage", ADVANTAGES), ("loss", LOSSES), ("engine", ENGINES)])
def test_the_config_variants_and_the_trainer_registries_agree(field: str, registry: dict) -> None:
    """Every built-in variant the run config describes has its registry entry, and the entry takes
    what the trainer passes plus the variant's own fields; the registry has nothing else."""
    parts = variants(TrainerConfig.model_fields[field])
    assert set(parts) - {BY_PATH} == set(registry)
    for name, variant in parts.items():
        if name != BY_PATH:
            required = {"teacher": "t"} if name == "opd" else {}  # a field without a default
            variant.check_call(registry[name], variant.model_validate(required).kwargs())


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


def test_each_environment_takes_its_own_echo_weight() -> None:
    from flywheel.contract.config import RunConfig
    from flywheel_trainer.join import Scored, sequences_of
    from flywheel_trainer.learner import rl_step
    from tests.unit.test_trainer_join import make_rollout

    def multi_turn(rollout_id: str, env: str) -> events.Rollout:
        """A rollout whose answer is followed by a tool's result and a second answer."""
        one = make_rollout(rollout_id, f"g-{env}", env=env, completion=[5, 6])
        tool = events.Message(role="tool", content="t")
        span = events.TokenSpan(token_ids=[7, 8], logprobs=[0.0, 0.0], loss_mask=[False, False])
        tool_node = events.Node(id=events.node_id(one.nodes[-1].id, tool, span), parent_id=one.nodes[-1].id,
                                message=tool, tokens=span)
        answer = events.Message(role="assistant", content="b")
        span2 = events.TokenSpan(token_ids=[9], logprobs=[-1.0], loss_mask=[True], policy_version=0)
        last = events.Node(id=events.node_id(tool_node.id, answer, span2), parent_id=tool_node.id, message=answer,
                           tokens=span2)
        return msgspec.structs.replace(one, nodes=[*one.nodes, tool_node, last], group_size=1)

    cfg = RunConfig.parse({"run": "r", "group_size": 1, "trainer": {"batch_size": 2, "echo": 0.5},
                           "envs": [{"id": "a", "echo": 0}, {"id": "b"}]})
    groups = [[Scored(multi_turn(env, env), 0.0, 0)] for env in ("a", "b")]
    assert [sequences_of(g[0].rollout)[0].env_mask for g in groups] == [[False] * 6 + [True, True, False]] * 2
    envs = {env.id: env for env in cfg.environments}
    figures = rl_step(RecordingEngine(Bigram()), groups, 0, cfg, 2, envs)
    assert figures["num_env_tokens"] == 2  # b's tool result only: a's own weight is 0
    unechoed = RunConfig.parse({"run": "r", "group_size": 1, "trainer": {"batch_size": 2},
                                "envs": [{"id": "a"}, {"id": "b"}]})
    assert "echo_loss" not in rl_step(RecordingEngine(Bigram()), groups, 0, unechoed, 2,
                                      {env.id: env for env in unechoed.environments})


def test_opd_gives_each_sampled_token_the_teachers_logprob_less_the_sampled_one_centered() -> None:
    """OPD's per-token advantage, coef x (teacher - sampled logprob) less its mean over the step's
    sampled tokens, trains like that advantage given by hand; rewards mix in by reward_weight, and
    a KL term adds its own part."""
    from flywheel.contract.config import RunConfig
    from flywheel_trainer.join import Scored, sequences_of
    from flywheel_trainer.learner import rl_step
    from tests.unit.test_trainer_join import make_rollout, make_signal

    rollouts = [make_rollout(f"r{i}", "g", index=i, completion=[5 + i, 6 + i], logprobs=[-1.0, -1.0])
                for i in range(2)]
    seqs = [s for r in rollouts for s in sequences_of(r)]

    def groups(shift: float = 0.0) -> list[list[Scored]]:
        """The teacher likes r0's tokens more than the policy did (-0.5 against -1) and r1's less (-1.5)."""
        return [[Scored(r, reward, 0, signals={"t": make_signal(r, value=value + shift)})
                 for r, reward, value in zip(rollouts, (1.0, 0.0), (-0.5, -1.5), strict=True)]]

    def grads_of_rl(trainer: dict, shift: float = 0.0) -> tuple[list[torch.Tensor], dict[str, float]]:
        teachers = {"teachers": {"t": {"model": "m"}}} if trainer else {}
        cfg = RunConfig.parse({"run": "r", "env": "reverse_text", "group_size": 2, **teachers,
                               "trainer": {"batch_size": 2, **trainer}})
        engine = RecordingEngine(Bigram())
        figures = rl_step(engine, groups(shift), 0, cfg, 2, {"reverse_text": cfg.environments[0]})
        return engine.grads, figures

    def grads_by_hand(advantages: list[float]) -> list[torch.Tensor]:
        engine = RecordingEngine(Bigram())
        train_step(engine, seqs, advantages, 0, 2, [1.0, 1.0], policy_gradient)
        return engine.grads

    def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return all(torch.allclose(a, b, atol=1e-6) for a, b in zip(x, y, strict=True))

    # r0's tokens +0.5, r1's -0.5 (their mean is 0), whatever the rewards.
    grads, figures = grads_of_rl({"advantage": {"type": "opd", "teacher": "t"}})
    assert same(grads, grads_by_hand([0.5, -0.5]))
    assert figures["teacher.t.kl"] == pytest.approx(0.0) and figures["advantage_abs_mean"] == 0.0
    # Centered: a teacher that likes every token 2 nats less trains the same (its kl figure says so).
    shifted, figures = grads_of_rl({"advantage": {"type": "opd", "teacher": "t"}}, shift=-2.0)
    assert same(shifted, grads) and figures["teacher.t.kl"] == pytest.approx(2.0)
    # With the rewards' group-mean advantage (+-0.5) at weight 1: 1.0 and -1.0.
    grads, _ = grads_of_rl({"advantage": {"type": "opd", "teacher": "t", "coef": 1.0, "reward_weight": 1.0}})
    assert same(grads, grads_by_hand([1.0, -1.0]))
    # GRPO with a KL term toward the teacher: +-0.5 plus 0.2 x +-0.5.
    grads, figures = grads_of_rl({"kl": {"teacher": "t", "coef": 0.2}})
    assert same(grads, grads_by_hand([0.6, -0.6])) and "teacher.t.kl" in figures
    # Without teachers a step has no per-token part and no teacher figure.
    grads, figures = grads_of_rl({})
    assert same(grads, grads_by_hand([0.5, -0.5])) and not any(k.startswith("teacher.") for k in figures)


def test_top_k_divergence_is_the_exact_kl_when_the_top_k_hold_the_whole_vocabulary() -> None:
    """With every token in the top-k the tail bucket is empty: the forward and reverse KL of
    the two distributions, to float rounding; fewer valid entries than K change nothing."""
    from flywheel_trainer.losses import top_k_divergence

    torch.manual_seed(1)
    student = torch.log_softmax(torch.randn(3, 5), -1)
    teacher = torch.log_softmax(torch.randn(3, 5), -1)
    top = teacher.topk(5, -1)
    valid = torch.ones(3, 5, dtype=torch.bool)
    forward = (teacher.exp() * (teacher - student)).sum(-1)
    reverse = (student.exp() * (student - teacher)).sum(-1)
    both = torch.tensor([True, False, True])
    got = top_k_divergence(student, top.indices, top.values, valid, both)
    assert torch.allclose(got, torch.where(both, forward, reverse), atol=1e-4)
    # One padding column (invalid) beside the five: the same, and a finite gradient.
    ids = torch.cat([top.indices, torch.zeros(3, 1, dtype=torch.long)], -1)
    logprobs = torch.cat([top.values, torch.full((3, 1), 7.0)], -1)
    padded_valid = torch.cat([valid, torch.zeros(3, 1, dtype=torch.bool)], -1)
    leaf = student.clone().requires_grad_(True)
    padded = top_k_divergence(leaf, ids, logprobs, padded_valid, both)
    padded.sum().backward()
    assert torch.allclose(padded, got, atol=1e-5) and leaf.grad is not None and torch.isfinite(leaf.grad).all()
    # Equal distributions: 0 either way.
    assert torch.allclose(top_k_divergence(teacher, top.indices, top.values, valid, both), torch.zeros(3), atol=1e-5)


def test_top_k_divergence_with_a_tail_bucket_is_the_kl_of_the_bucketed_distributions() -> None:
    from flywheel_trainer.losses import top_k_divergence

    student = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    teacher_top = torch.log(torch.tensor([[0.7, 0.2]]))  # tokens 0 and 1; the rest 0.1
    ids = torch.tensor([[0, 1]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.1, 0.2, 0.7])
    forward = top_k_divergence(student, ids, teacher_top, valid, torch.tensor([True]))
    reverse = top_k_divergence(student, ids, teacher_top, valid, torch.tensor([False]))
    assert float(forward) == pytest.approx(float((p * (p / q).log()).sum()), abs=1e-5)
    assert float(reverse) == pytest.approx(float((q * (q / p).log()).sum()), abs=1e-5)


def test_dense_opd_adds_the_top_k_divergence_at_sampled_positions_and_moves_the_policy_to_the_teacher() -> None:
    """An opd advantage with a top-k estimate: the step's loss is the weighted mean divergence over
    the sampled tokens (the prompt's positions get none), the rewards' part stays at its weight,
    and steps on it bring the policy's distribution over those tokens to the teacher's."""
    from flywheel.contract.config import RunConfig
    from flywheel_trainer.engines import TorchEngine
    from flywheel_trainer.join import Scored, sequences_of
    from flywheel_trainer.learner import rl_step
    from flywheel_trainer.losses import top_k_divergence
    from tests.unit.test_trainer_join import make_rollout, make_signal

    vocab = 12
    target = torch.log_softmax(torch.linspace(3.0, -3.0, vocab), -1)  # the teacher's, whatever the context
    top = target.topk(4)
    rollouts = [make_rollout(f"r{i}", "g", index=i, completion=[5 + i, 6 + i], logprobs=[-1.0, -1.0])
                for i in range(2)]

    def with_top(rollout: events.Rollout) -> events.Signal:
        """The teacher's value -1.0 and its top-4 at each sampled token."""
        spans = {n.id: n.tokens.loss_mask for n in rollout.nodes if n.tokens is not None and any(n.tokens.loss_mask)}
        return msgspec.structs.replace(
            make_signal(rollout, value=-1.0),
            top_ids={n: [top.indices.tolist() if m else [] for m in mask] for n, mask in spans.items()},
            top_logprobs={n: [top.values.tolist() if m else [] for m in mask] for n, mask in spans.items()})

    groups = [[Scored(r, reward, 0, signals={"t": with_top(r)}) for r, reward in zip(rollouts, (1.0, 0.0),
                                                                                        strict=True)]]
    cfg = RunConfig.parse({"run": "r", "env": "reverse_text", "group_size": 2, "teachers": {"t": {"model": "m"}},
                           "trainer": {"batch_size": 2, "lr": 0.05, "advantage": {
                               "type": "opd", "teacher": "t", "estimate": "forward_top_k", "top_k": 4}}})
    assert cfg.top_k_of("t") == 4 and cfg.teachers_of(cfg.environments[0]) == ["t"]
    envs = {"reverse_text": cfg.environments[0]}
    model = Bigram(vocab)
    figures = rl_step(RecordingEngine(model), groups, 0, cfg, 2, envs)
    # The loss is the distillation term alone (reward_weight 0): its mean over the 4 sampled tokens.
    expected = []
    with torch.no_grad():
        for s in (seq for r in rollouts for seq in sequences_of(r)):
            logits = model(torch.tensor([s.token_ids]), None).logits[0]
            for position, sampled in enumerate(s.loss_mask):
                if sampled:
                    expected.append(float(top_k_divergence(torch.log_softmax(logits[position - 1:position], -1),
                                                           top.indices[None], top.values[None],
                                                           torch.ones(1, 4, dtype=torch.bool),
                                                           torch.tensor([True]))))
    assert figures["distill_loss"] == pytest.approx(sum(expected) / 4, abs=1e-5)
    assert figures["loss"] == pytest.approx(figures["distill_loss"], abs=1e-5)
    assert figures["teacher.t.kl"] == pytest.approx(0.0)  # sampled -1.0, teacher's value -1.0
    # Trained on it, the policy's next-token distribution after token 5 comes to the teacher's top-4.
    engine = TorchEngine(model, cfg.trainer, "float32")
    first = figures["distill_loss"]
    for _ in range(200):
        figures = rl_step(engine, groups, 0, cfg, 2, envs)
    assert figures["distill_loss"] < first / 10
    with torch.no_grad():
        learned = torch.softmax(model(torch.tensor([[5]]), None).logits[0, 0], -1)
    # The teacher's top-4 probabilities, and the rest as one bucket (how it is spread is not learned).
    assert torch.allclose(learned[top.indices], top.values.exp(), atol=0.02)
