"""A service's heap, frozen out of the cyclic garbage collector once it is built.

A service's heap is mostly what it imported and loaded once (torch and transformers hold
millions of objects): without freezing, each full collection walks all of it again, about
0.15 CPU-s a time in inference, a tenth of its CPU over a run. A service's own process
opts in from its entry point (:func:`enable_heap_freeze`, in its ``__main__`` block: this
module imports nothing, so ``--help`` stays light); :meth:`flywheel.contract.service.Service.run`
and the model loaders then call :func:`freeze_heap`. A process that runs a service beside
other work (a test, a tool) keeps its collector as it is.
"""

from __future__ import annotations

import gc

# freeze_heap: set by a service's entry point (enable_heap_freeze), never where a service is embedded.
_PROCESS = {"freeze_heap": False}


def enable_heap_freeze() -> None:
    """Called by a service's entry point (its ``__main__`` block): the process is the service's
    own, so :func:`freeze_heap` takes effect in it."""
    _PROCESS["freeze_heap"] = True


def freeze_heap() -> None:
    """Leave every object alive now out of the cyclic garbage collector's future passes
    (:func:`gc.freeze`), in a service's own process (:func:`enable_heap_freeze`). Called when a
    service starts and after a model is loaded; the objects made afterwards are collected as
    usual. What is frozen is never collected as cyclic garbage, so it is called on what stays
    for the process's life, not on work in progress."""
    if _PROCESS["freeze_heap"]:
        gc.freeze()
