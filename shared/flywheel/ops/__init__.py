"""The operator's tools: ``cli`` (the ``flywheel`` command), ``stack`` (``flywheel up``),
``run`` (``flywheel run``), ``eval`` (``flywheel eval``), ``scaffold`` (``flywheel env init``),
``natsserver`` (a local nats-server), ``client`` (tasks and the trace API from Python),
``tables`` (the commands' text tables). Imports the contract and the SDK.
"""
