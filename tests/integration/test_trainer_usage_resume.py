"""A trainer that resumes from a checkpoint counts that checkpoint's step again, and it is billed once.

The trainer publishes a step's :class:`~flywheel.contract.events.Usage` (id
``<run>.trainer.<step>``) after its checkpoint and its weights: one killed in between resumed
from that step and never counted it. At a resume it now publishes the checkpoint's step's
usage again, under the same id.

``python -m flywheel_trainer --run RUN`` runs as a subprocess against the test's nats-server
(as in test_trainer_kill.py), on a one-step run: each life after the first resumes from the
step-1 checkpoint, publishes again and exits, the run being done. The test plays inference
and the scorers (test_trainer_bus.py's :class:`Inference`).

- A resume with the usage on the bus: still one message with that id (the server's
  duplicate window).
- A resume after the usage was taken off the bus (deleted from the USAGE stream, its id
  forgotten by the server, as if it had never been published: the trainer died before):
  the usage of step 1 is on the bus again, same id, same trained tokens and rollouts.
- The gateway's usage accounting, given both copies (what the recorder sees of a resume after
  the server's duplicate window), counts the step once.

Only the processes these tests start are stopped.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import nats.js.errors
import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, decode_message
from flywheel.runtime.natsserver import NatsServer
from flywheel_gateway.store import Store
from tests.helpers import until
from tests.integration.test_trainer_kill import TrainerProcess, new_run

RUN = "usage-resume"
SUBJECT = f"usage.{RUN}.trainer"


async def trainer_usage(bus: Bus) -> list[tuple[int, events.Usage]]:
    """Every trainer usage count of the run on the USAGE stream: (stream sequence, event), in order."""
    decoder: events.Decoder[events.Usage] = events.Decoder(events.Usage)
    found: list[tuple[int, events.Usage]] = []
    seq = 1
    while True:
        try:
            msg = await bus.js.get_msg("USAGE", seq, subject=SUBJECT, next=True)
        except nats.js.errors.NotFoundError:
            return found
        assert msg.seq is not None
        found.append((msg.seq, decode_message(decoder, msg)))
        seq = msg.seq + 1


async def forget_published_ids(bus: Bus) -> None:
    """Make the server forget the ids of what the USAGE stream took (its duplicate window, 2
    minutes, remembers them even after their message is deleted): as if they had never been
    published. The window is shrunk to its least (100 ms) until a probe id published now is
    forgotten, then set back."""
    probe = events.Usage(id=f"{RUN}.probe", run=f"{RUN}-probe", source="trainer", step=0)
    await bus.publish(probe)
    config = (await bus.js.stream_info("USAGE")).config
    window = config.duplicate_window
    config.duplicate_window = 0.1
    await bus.js.update_stream(config)
    try:
        async def forgotten() -> bool:
            return not (await bus.publish(probe)).duplicate

        await until(forgotten, timeout_s=10, what="the USAGE stream to forget the ids it took")
    finally:
        config.duplicate_window = window
        await bus.js.update_stream(config)


async def life(trainer: TrainerProcess) -> None:
    """Start the trainer; it resumes (or starts), trains what is left of the run and exits 0."""
    trainer.start()
    assert await trainer.wait(timeout_s=90) == 0, trainer.log_path.read_text()[-3000:]


@pytest.mark.long
async def test_a_resumed_trainer_counts_its_checkpoints_step_again_and_it_is_billed_once(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path, client: httpx.AsyncClient,
        store: Store) -> None:
    trainer, inference, _ = await new_run(bus, nats_server, tiny_model_dir, tmp_path, RUN, num_steps=1)
    try:
        trainer.start()
        await trainer.published(bus, 0)
        await inference.group("g0", 0)
        await inference.group("g1", 0)
        assert await trainer.wait(timeout_s=90) == 0, trainer.log_path.read_text()[-3000:]  # step 1, finished
        [(seq, first)] = await trainer_usage(bus)
        assert (first.id, first.step, first.source) == (f"{RUN}.trainer.1", 1, "trainer")
        assert first.trained_tokens > 0 and sorted(first.rollout_ids) == sorted(inference.published)

        # Resumed with the count on the bus: published again, deduplicated by the server.
        await life(trainer)
        assert trainer.log_path.read_text().count("resuming from") == 1
        assert await trainer_usage(bus) == [(seq, first)], "one message for the step's id"

        # Resumed with the count lost (the trainer died after its checkpoint, before counting).
        await bus.js.delete_msg("USAGE", seq)
        await forget_published_ids(bus)
        assert await trainer_usage(bus) == []
        await life(trainer)
        assert trainer.log_path.read_text().count("resuming from") == 2
        again = await trainer_usage(bus)
        assert again, "the resumed trainer did not count its checkpoint's step 1 again: its trained tokens are lost"
        [(seq_again, counted)] = again
        assert seq_again > seq
        assert (counted.id, counted.run, counted.source, counted.step, counted.tenant) == (
            first.id, first.run, first.source, first.step, first.tenant)
        assert (counted.trained_tokens, counted.sft_tokens, counted.rollout_ids) == (
            first.trained_tokens, first.sft_tokens, first.rollout_ids)
    finally:
        trainer.stop()

    # The gateway's accounting, given the count twice (as the recorder records it when a resume
    # comes after the server's duplicate window), bills the step once.
    await store.record([first])
    await store.record([counted])
    answer = await client.get("/v1/usage", params={"run": RUN})
    assert answer.status_code == 200, answer.text
    rows = [row for row in answer.json()["items"] if row["source"] == "trainer"]
    assert [(row["num_counts"], row["trained_tokens"]) for row in rows] == [(1, first.trained_tokens)]
