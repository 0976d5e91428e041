"""Batches line up with their tokens; recomputed logprobs match the sampler's; steps learn.

The completions are sampled here with a plain loop, by the definition inference uses
(``log_softmax(logits / temperature)`` in float32 of the sampled token), on the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.contract import events
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import TrainerSettings
from flywheel.runtime.envworker import LoadSpec
from flywheel.sdk import models
from flywheel_trainer.batch import Batch, loss_logprobs, micro_batches, pack, packed_loss_logprobs, pad, token_logprobs
from flywheel_trainer.chats import DataError
from flywheel_trainer.engines import TorchEngine
from flywheel_trainer.join import Scored, Tokens, tokens_of
from flywheel_trainer.learner import (
    SFTSupply,
    reference_examples,
    reference_steps,
    reference_tokens,
    rl_step,
    sft_warmup,
    term_references,
    warmup_steps,
)
from tests.inprocess import InProcessPool
from tests.unit.test_trainer_join import make_rollout

MICRO_BATCH_SIZE = TrainerSettings().micro_batch_size
PROMPT = [events.Message(role="system", content="Reverse the text."), events.Message(role="user", content="abcd")]


def sample(model: torch.nn.Module, prompt: list[int], max_tokens: int, temperature: float, eos: int,
           seed: int) -> tuple[list[int], list[float]]:
    """A plain sampling loop, no cache: (completion ids, logprob of each sampled token)."""
    generator = torch.Generator().manual_seed(seed)
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            step = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = int(torch.multinomial(step.exp(), 1, generator=generator))
            ids.append(token)
            out.append(token)
            logprobs.append(float(step[token]))
            if token == eos:
                break
    return out, logprobs


def sampled_rollouts(model: torch.nn.Module, tok: object, n: int, temperature: float) -> list[events.Rollout]:
    """``n`` completions of different lengths (the random tiny model seldom ends one by itself)."""
    prompt = models.render_prompt(tok, PROMPT)
    rollouts = []
    for i in range(n):
        completion, logprobs = sample(model, prompt, 4 + 3 * i, temperature,
                                      tok.eos_token_id, seed=i)  # type: ignore[attr-defined]  # tok: an HF tokenizer
        rollouts.append(make_rollout(f"r{i}", "g", prompt=prompt, completion=completion, logprobs=logprobs,
                                     group_size=n))
    return rollouts


def test_padding_shifts_masks_and_logprobs_onto_the_target_tokens() -> None:
    seqs = [Tokens([1, 2, 3], [0.0, -0.1, -0.2], [False, True, True]), Tokens([4, 5], [0.0, -0.3], [False, True])]
    batch = pad(seqs, [1.0, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.loss_mask.tolist() == [[True, True], [True, False]]  # target tokens 2, 3 and 5
    assert batch.old_logprobs.flatten().tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert batch.num_loss_tokens == 3 and batch.num_tokens == 5
    lengths = [3, 7, 1, 5, 2]
    cut = micro_batches([Tokens([0] * n, [0.0] * n, [False] * n) for n in lengths], 2)
    assert cut == [[1, 3], [0, 4], [2]]  # longest first


def test_micro_batches_are_bounded_by_padded_tokens_and_give_each_rank_a_pass() -> None:
    lengths = [3, 7, 1, 5, 2, 2]
    seqs = [Tokens([0] * n, [0.0] * n, [False] * n) for n in lengths]
    # Longest first: 7 + 5 pad to 14 tokens, so 7 goes alone under 12; a sequence longer than
    # the bound still gets a pass of its own.
    assert micro_batches(seqs, 100, max_tokens=12) == [[1], [3, 0], [4, 5, 2]]
    assert micro_batches(seqs, 100, max_tokens=4) == [[1], [3], [0], [4, 5], [2]]
    assert micro_batches(seqs, 100) == [[1, 3, 0, 4, 5, 2]]
    assert micro_batches(seqs, 100, min_passes=2) == [[1, 3, 0], [4, 5, 2]]  # one pass for each of two ranks
    assert micro_batches(seqs, 100, min_passes=10) == [[i] for i in (1, 3, 0, 4, 5, 2)]


def test_micro_batches_keep_the_sequences_of_one_prompt_together() -> None:
    def seq(prompt: list[int], n: int) -> Tokens:
        return Tokens(prompt + [9] * n, [0.0] * (len(prompt) + n), [False] * len(prompt) + [True] * n)

    seqs = [seq([1, 2, 3], 2), seq([4, 5], 6), seq([1, 2, 3], 5), seq([4, 5], 1), seq([1, 2, 3], 1)]
    assert micro_batches(seqs, 3) == [[1, 3, 2], [0, 4]]  # families by their longest member
    batch = pad([seqs[i] for i in (2, 0, 4)], [0.0] * 3, pad_id=0)
    assert batch.prefix is not None and batch.prefix.input_ids.tolist() == [[1, 2]]
    assert batch.input_ids[:, 0].tolist() == [3, 3, 3]  # rows go on from the prompt's last token
    assert batch.num_tokens == 2 + (6 + 3 + 2)  # the shared prefix counted once
    assert pad([seqs[i] for i in (2, 0, 4)], [0.0] * 3, pad_id=0, share_prefixes=False).prefix is None


def packed_in_rows_of_12(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    from flywheel_trainer import batch as batches

    original = batches.PACK_ROW_TOKENS
    batches.PACK_ROW_TOKENS = 12
    try:
        return packed_loss_logprobs(model, batch)
    finally:
        batches.PACK_ROW_TOKENS = original


def test_a_shared_prefix_and_packed_rows_give_the_logprobs_and_gradients_of_whole_rows(tiny_model_dir: Path) -> None:
    """Prompts of several lengths, each with completions of several lengths, one prompt alone,
    one sequence with nothing to train: run once per prompt or on whole rows, the same numbers."""
    model, tok = models.load_model(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 200, (n,), generator=generator).tolist()

    seqs = []
    for prompt_length, completions in ((9, (4, 7, 2)), (5, (6, 3)), (7, (5,))):
        prompt = ids(prompt_length)
        for n in completions:
            seqs.append(Tokens(prompt + ids(n), [-1.0] * (prompt_length + n), [False] * prompt_length + [True] * n))
    seqs.append(Tokens(ids(6), [0.0] * 6, [False] * 6))
    temperatures = [1.0, 0.7, 1.0, 0.9, 1.0, 1.0, 1.0]
    results = []
    # Each way: a shared prefix or whole rows; the head on every position, on the loss's alone,
    # or on the loss's alone with the rows packed (no padding; a prefix once in its family's row).
    ways = {"whole": token_logprobs, "loss": loss_logprobs, "packed": packed_loss_logprobs,
            "packed in rows of 12": packed_in_rows_of_12}
    for share, way in ((True, "whole"), (False, "whole"), (True, "loss"), (False, "loss"), (True, "packed"),
                       (False, "packed"), (True, "packed in rows of 12")):
        model.zero_grad()
        batch = pad(seqs, [1.0] * len(seqs), tok.pad_token_id, temperatures=temperatures, share_prefixes=share)
        assert (batch.prefix is not None) == share
        logprobs = ways[way](model, batch)[batch.loss_mask]
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (whole, whole_grads) = results[1]
    assert whole.numel() == sum(sum(s.loss_mask) for s in seqs)
    for logprobs, grads in results:
        assert float((logprobs - whole).abs().max()) <= 1e-5
        assert len(grads) == len(whole_grads) > 0
        for a, b in zip(grads, whole_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_packed_micro_batch_holds_each_shared_beginning_once_and_each_token_sees_its_own_path() -> None:
    seqs = [Tokens([1, 2, 3, 4, 5], [0.0] * 5, [False] * 3 + [True] * 2),
            Tokens([1, 2, 3, 6], [0.0] * 4, [False] * 3 + [True]),
            Tokens([1, 7, 8], [0.0] * 3, [False, True, True]),
            Tokens([1, 2, 3, 6], [0.0] * 4, [False] * 3 + [True])]  # the same as the second
    for share in (True, False):  # the prompt [1, 2] as a prefix of its rows, or whole rows: one layout
        batch = pad(seqs, [0.0] * 4, pad_id=0, share_prefixes=share)
        packed = pack(batch)
        assert packed is not None
        # Longest first (micro-batch order is the caller's): [1, 2, 3, 4, 5], then 6 after 3, then 7, 8 after 1.
        order = packed.input_ids[0].tolist()
        assert sorted(order) == [1, 2, 3, 4, 5, 6, 7, 8], order
        place = {t: i for i, t in enumerate(order)}
        assert packed.position_ids[0].tolist() == [{1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 3, 7: 1, 8: 2}[t] for t in order]
        sees = packed.mask[0, 0]
        for t, path in {6: [1, 2, 3, 6], 8: [1, 7, 8], 5: [1, 2, 3, 4, 5]}.items():
            assert sorted(order[j] for j in sees[place[t]].nonzero().flatten().tolist()) == path
        for row_tokens in (1024, 6):  # one packed row, or a new row past 6 tokens
            packed = pack(batch, row_tokens)
            assert packed is not None and packed.input_ids.shape[0] == (1 if row_tokens == 1024 else 2)
            flat_ids, flat_positions = packed.input_ids.flatten(), packed.position_ids.flatten()
            for row in range(len(seqs)):  # each batch position maps to the packed token it is
                n = int(batch.attention_mask[row].sum())
                assert flat_ids[packed.at[row, :n]].tolist() == batch.input_ids[row, :n].tolist()
                start = 0 if batch.prefix is None else int(batch.prefix.lengths[row])
                assert flat_positions[packed.at[row, :n]].tolist() == list(range(start, start + n))


def test_a_micro_batch_too_large_to_pack_runs_padded(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel_trainer import batch as batches

    model, tok = models.load_model(tiny_model_dir)
    seqs = [Tokens(list(range(3, 3 + n)), [0.0] * n, [False] * 2 + [True] * (n - 2)) for n in (6, 9)]
    batch = pad(seqs, [0.0] * 2, tok.pad_token_id, temperatures=[1.0, 1.0])
    monkeypatch.setattr(batches, "MAX_PACKED_TOKENS", 8)
    assert pack(batch) is None  # a sequence of 9 tokens
    with torch.no_grad():
        assert torch.equal(packed_loss_logprobs(model, batch), loss_logprobs(model, batch))
    monkeypatch.setattr(batches, "MAX_PACKED_TOKENS", 9)
    assert pack(batch) is not None
    # A prompt's sequences stay in one row: four of 5 tokens sharing 2 make a row of 14.
    monkeypatch.setattr(batches, "MAX_PACKED_TOKENS", 13)
    family = [Tokens([1, 2, *range(10 + 3 * i, 13 + 3 * i)], [0.0] * 5, [False] * 2 + [True] * 3) for i in range(4)]
    assert pack(pad(family, [0.0] * 4, tok.pad_token_id, share_prefixes=False), row_tokens=4) is None
    monkeypatch.setattr(batches, "MAX_PACKED_TOKENS", 14)
    assert pack(pad(family, [0.0] * 4, tok.pad_token_id, share_prefixes=False), row_tokens=4) is not None


@pytest.mark.parametrize("options", [{"pack": True}, {"activation_checkpointing": True},
                                     {"pack": True, "activation_checkpointing": True}])
def test_packing_and_activation_checkpointing_step_as_the_default_does(tiny_model_dir: Path,
                                                                       options: dict[str, bool]) -> None:
    # The step's loss and gradient norm, then the next step's loss (after the first update).
    steps = []
    for trainer in ({}, options):
        model, tok = models.load_model(tiny_model_dir)
        cfg = RunConfig(run="t", env="reverse_text", group_size=4,
                        trainer={"batch_size": 4, "lr": 1e-3, **trainer})
        rollouts = sampled_rollouts(model, tok, 4, 1.0)
        engine = TorchEngine(model, cfg.trainer, cfg.model.dtype)
        assert engine.activation_checkpointing == cfg.trainer.activation_checkpointing
        group = [Scored(r, reward, 0) for r, reward in zip(rollouts, [1.0, 0.0, 0.5, 0.0], strict=True)]
        steps.append([rl_step(engine, [group], tok.pad_token_id, cfg, MICRO_BATCH_SIZE) for _ in range(2)])
    (default_first, default_second), (first, second) = steps
    assert first["loss"] == pytest.approx(default_first["loss"], rel=1e-4, abs=1e-6)
    assert first["grad_norm"] == pytest.approx(default_first["grad_norm"], rel=1e-4)
    assert second["loss"] == pytest.approx(default_second["loss"], rel=1e-3, abs=1e-5)
    assert second["loss"] != pytest.approx(first["loss"], rel=1e-3)  # the first step moved the weights


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_match_the_sampled_ones_under_the_same_weights(tiny_model_dir: Path,
                                                                          temperature: float) -> None:
    model, tok = models.load_model(tiny_model_dir)
    rollouts = sampled_rollouts(model, tok, 4, temperature)
    seqs = [tokens_of(r) for r in rollouts]
    assert len({len(s.token_ids) for s in seqs}) > 1, "completions of different lengths, so padding is exercised"
    batch = pad(seqs, [0.0] * len(seqs), tok.pad_token_id, temperatures=[temperature] * len(seqs))
    with torch.no_grad():
        recomputed = token_logprobs(model, batch)
    diff = (recomputed - batch.old_logprobs).abs()[batch.loss_mask]
    assert diff.numel() == sum(sum(s.loss_mask) for s in seqs)
    assert float(diff.mean()) <= 1e-3 and float(diff.max()) <= 1e-2


def test_a_step_recomputes_each_rollout_at_the_temperature_it_was_sampled_with(tiny_model_dir: Path) -> None:
    # The run samples at 1.0; these rollouts were sampled at 0.5 (a task's own setting). With
    # lr 0 the weights stay, so the trainer's logprobs match the sampler's only at 0.5.
    import msgspec

    model, tok = models.load_model(tiny_model_dir)
    cfg = RunConfig(run="t", env="reverse_text", group_size=4, trainer={"batch_size": 4, "lr": 0.0})
    rollouts = sampled_rollouts(model, tok, 4, 0.5)
    engine = TorchEngine(model, cfg.trainer, cfg.model.dtype)

    def gap(rs: list[events.Rollout]) -> float:
        group = [Scored(r, float(i), 0) for i, r in enumerate(rs)]
        return rl_step(engine, [group], tok.pad_token_id, cfg, MICRO_BATCH_SIZE)["logprob_diff_abs_mean"]

    recorded = [msgspec.structs.replace(r, sampling=events.Sampling(temperature=0.5)) for r in rollouts]
    assert gap(recorded) < 1e-3
    assert gap(rollouts) > 1e-2  # a rollout that does not say is taken at the run's 1.0


def sequence_logprob(model: torch.nn.Module, rollout: events.Rollout, temperature: float) -> float:
    batch = pad([tokens_of(rollout)], [0.0], 0, temperatures=[temperature])
    with torch.no_grad():
        return float(token_logprobs(model, batch)[batch.loss_mask].sum())


@pytest.mark.parametrize("loss", ["clipped", "masked"])
def test_steps_on_a_fixed_batch_raise_the_good_completion_and_lower_the_loss(tiny_model_dir: Path, loss: str) -> None:
    model, tok = models.load_model(tiny_model_dir)
    cfg = RunConfig(run="t", env="reverse_text", group_size=4,
                    trainer={"batch_size": 4, "lr": 3e-3, "loss": {"type": loss, "clip_eps": 0.5}})
    rollouts = sampled_rollouts(model, tok, 4, cfg.sampling.temperature)
    group = [Scored(r, reward, 0) for r, reward in zip(rollouts, [1.0, 0.0, 0.0, 0.0], strict=True)]
    before = [sequence_logprob(model, r, 1.0) for r in rollouts]
    engine = TorchEngine(model, cfg.trainer, cfg.model.dtype)
    losses = [rl_step(engine, [group], tok.pad_token_id, cfg, MICRO_BATCH_SIZE)["loss"] for _ in range(4)]
    after = [sequence_logprob(model, r, 1.0) for r in rollouts]
    assert after[0] > before[0] + 0.1
    assert sum(after[1:]) < sum(before[1:])
    if loss == "clipped":  # the surrogate it minimises; masking changes which tokens count, step to step
        assert losses[-1] < losses[0]


async def test_sft_warmup_teaches_the_reference_answers(tiny_model_dir: Path) -> None:
    model, tok = models.load_model(tiny_model_dir)
    pool = InProcessPool()
    env = await pool.load(LoadSpec(env_id="reverse_text"))
    cfg = RunConfig(run="t", env="reverse_text", sft={"steps": 8, "batch_size": 16, "lr": 3e-3})
    held_out = [reference_tokens(tok, *e) for e in await env.references(await env.load_tasks(8, seed=123))]
    assert tok.decode(held_out[0].token_ids).endswith("<|im_end|>")

    def cross_entropy() -> float:
        batch = pad(held_out, [0.0] * len(held_out), tok.pad_token_id)
        with torch.no_grad():
            return float(-token_logprobs(model, batch)[batch.loss_mask].mean())

    start = cross_entropy()
    examples = await reference_examples([env], cfg)
    figures = sft_warmup(model, warmup_steps(model, tok, examples, cfg), tok.pad_token_id, cfg, MICRO_BATCH_SIZE)
    assert figures["sft_steps"] == 8 and cross_entropy() < start - 0.5
    await pool.close()


async def test_a_warm_up_context_comes_first_in_its_share_of_the_reference_answers(tiny_model_dir: Path) -> None:
    _, tok = models.load_model(tiny_model_dir)
    pool = InProcessPool()
    env = await pool.load(LoadSpec(env_id="reverse_text"))
    (task,) = await env.load_tasks(1, seed=0)
    (hinted_example, plain_example) = await env.references([task, task], ["Answer: {answer}", None])
    hinted, plain = reference_tokens(tok, *hinted_example), reference_tokens(tok, *plain_example)
    text = tok.decode(hinted.token_ids)
    assert text.index(f"Answer: {task['text'][::-1]}") < text.index("Reverse the text.")
    # The same answer to learn, after a longer prompt.
    assert sum(hinted.loss_mask) == sum(plain.loss_mask)
    assert hinted.token_ids[-sum(plain.loss_mask):] == plain.token_ids[-sum(plain.loss_mask):]

    async def shown(share: float) -> list[bool]:
        cfg = RunConfig(run="t", env="reverse_text", sft={"steps": 4, "batch_size": 16, "context": "Answer: {answer}",
                                                          "context_share": share})
        tasks = await env.load_tasks(64, seed=cfg.task_seed)
        plain_rows = [reference_tokens(tok, *e) for e in await env.references(tasks)]
        steps = reference_steps(tok, await reference_examples([env], cfg), cfg)
        return [len(row.token_ids) > len(plain_rows[step * 16 + i].token_ids)
                for step, rows in enumerate(steps) for i, row in enumerate(rows)]

    assert all(await shown(1.0)) and not any(await shown(0.0))
    half = await shown(0.5)
    assert 16 < sum(half) < 48 and half == await shown(0.5)  # about half, the same ones each time
    await pool.close()


async def test_the_sft_terms_rows_follow_from_the_step_and_teach_the_reference_answers_during_rl(
        tiny_model_dir: Path) -> None:
    model, tok = models.load_model(tiny_model_dir)
    cfg = RunConfig.from_toml_text(
        'run = "t"\ngroup_size = 2\n[[envs]]\nid = "reverse_text"\nsft_term = {weight = 1.0, batch_size = 16}\n'
        '[[envs]]\nid = "arithmetic"\n[trainer]\nnum_steps = 4\nlr = 3e-3\nbatch_size = 2\n')
    pool = InProcessPool()
    loaded = {env.id: (env, await pool.load(LoadSpec(env_id=env.id))) for env in cfg.environments}
    references = await term_references(loaded, cfg)
    configs = {name: env_cfg for name, (env_cfg, _) in loaded.items()}
    supply = SFTSupply(tok, configs, references, cfg)
    assert [name for name, _, _ in supply.pools] == ["reverse_text"]  # arithmetic has no term
    first = supply.rows(1)
    assert len(first.rows) == 16 and first.weights == [1.0] * 16
    assert [r.token_ids for r in SFTSupply(tok, configs, references, cfg).rows(1).rows] == [
        r.token_ids for r in first.rows]
    assert [r.token_ids for r in supply.rows(2).rows] != [r.token_ids for r in first.rows]
    env = loaded["reverse_text"][1]
    held_out = [reference_tokens(tok, *e) for e in await env.references(await env.load_tasks(8, seed=123))]
    await pool.close()

    def cross_entropy() -> float:
        batch = pad(held_out, [0.0] * len(held_out), tok.pad_token_id)
        with torch.no_grad():
            return float(-token_logprobs(model, batch)[batch.loss_mask].mean())

    # RL steps whose groups teach nothing (equal rewards: zero advantages): the term alone moves the model.
    rollouts = sampled_rollouts(model, tok, 2, 1.0)
    groups = [[Scored(r, reward=0.5, staleness=0) for r in rollouts]]
    engine = TorchEngine(model, cfg.trainer, "float32")
    start = cross_entropy()
    for step in range(1, 5):
        figures = rl_step(engine, groups, tok.pad_token_id, cfg, MICRO_BATCH_SIZE,
                          {env.id: env for env in cfg.environments}, supply.rows(step))
        assert figures["num_sft_tokens"] > 0 and figures["sft_term_loss"] > 0
    assert cross_entropy() < start - 0.3


def test_an_sft_term_draws_its_rows_from_a_datasets_dataset(tiny_model_dir: Path, tmp_path: Path) -> None:
    import datasets

    _, tok = models.load_model(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
            for t in ("abc", "dcba", "ef", "ghij")]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "extra": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "chats"))

    def supply(term: str) -> SFTSupply:
        cfg = RunConfig.from_toml_text(f'run = "t"\n[[envs]]\nid = "reverse_text"\nsft_term = {term}\n')
        return SFTSupply(tok, {env.id: env for env in cfg.environments}, {}, cfg)

    drawn = supply(f'{{weight = 1.0, dataset = "{tmp_path / "chats"}"}}').rows(1).rows
    texts = {tok.decode(r.token_ids) for r in drawn}
    assert len(texts) == 3 and any("cba" in t for t in texts) and not any("jihg" in t for t in texts)
    (extra,) = supply(f'{{weight = 1.0, dataset = "{tmp_path / "chats"}", split = "extra"}}').rows(1).rows
    assert "jihg" in tok.decode(extra.token_ids)
    with pytest.raises(DataError, match=r"envs\.0\.sft_term\.dataset='.*chats': no split 'test'; it has train, "
                                        r"extra \(envs\.0\.sft_term\.split\)"):
        supply(f'{{weight = 1.0, dataset = "{tmp_path / "chats"}", split = "test"}}')


def test_a_step_whose_loss_is_not_finite_changes_nothing_and_says_so(tiny_model_dir: Path) -> None:
    model, tok = models.load_model(tiny_model_dir)
    cfg = RunConfig(run="t", env="reverse_text", group_size=4, trainer={"batch_size": 4, "lr": 3e-3})
    rollouts = sampled_rollouts(model, tok, 4, cfg.sampling.temperature)
    engine = TorchEngine(model, cfg.trainer, cfg.model.dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # A reward no bound let through (the join never hands one out): the advantages, the loss and
    # the gradients are NaN.
    poisoned = [Scored(r, reward, 0) for r, reward in zip(rollouts, [float("nan"), 0.0, 1.0, 0.0], strict=True)]
    figures = rl_step(engine, [poisoned], tok.pad_token_id, cfg, MICRO_BATCH_SIZE)
    assert figures["num_skipped_nonfinite"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the weights stay
    assert not engine.optimizer.state  # nor does Adam's state take a step
    # The next step, on finite rewards, trains as usual.
    group = [Scored(r, reward, 0) for r, reward in zip(rollouts, [1.0, 0.0, 0.0, 0.0], strict=True)]
    figures = rl_step(engine, [group], tok.pad_token_id, cfg, MICRO_BATCH_SIZE)
    assert "num_skipped_nonfinite" not in figures
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
