"""A service's own process freezes its start-up heap out of the cyclic collector; a process
that runs a service beside other work (this one) keeps its collector as it is."""

from __future__ import annotations

import gc

import pytest

from flywheel.contract import heap


def test_the_heap_is_frozen_only_in_a_services_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    heap.freeze_heap()
    assert gc.get_freeze_count() == 0
    monkeypatch.setitem(heap._PROCESS, "freeze_heap", True)  # what enable_heap_freeze sets in a service's main
    kept: list[list[int]] = [[] for _ in range(10)]  # containers the collector tracks, alive now
    try:
        heap.freeze_heap()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
