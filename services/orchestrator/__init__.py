"""Orchestrator: owns every training run from its registration to its end, on the service side.

    service.py     claims runs from the run-state bucket and runs an owner for each
    owner.py       one run's owner: lease, trainer process, task supply, notes, summary and plot
    __main__.py    ``python -m flywheel_orchestrator``

``flywheel run CONFIG`` only registers a run (with its config) and follows it: the run goes
on when that process goes, and any orchestrator takes over a run whose owner died (its
lease ran out). Several orchestrators may run: each run has one owner, claimed by
compare-and-set on its state (:func:`flywheel.contract.runs.claim_run`).
"""
