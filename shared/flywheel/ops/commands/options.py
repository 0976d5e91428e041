"""The settings a command's options may override, as every command adds and reads them."""

from __future__ import annotations

import argparse
from typing import Any

# Settings a command line option may override, by their Settings field name: the option is
# --data-dir for data_dir, the variable FLYWHEEL_DATA_DIR, the TOML key data_dir.
SETTING_OPTIONS: dict[str, tuple[type, str]] = {
    "data_dir": (str, "state folder: NATS store, SQLite file, logs (default .flywheel)"),
    "nats_url": (str, "an existing NATS server (unset: the local one on NATS_PORT, which `flywheel up` starts)"),
    "nats_port": (int, "port of the local nats-server, used when NATS_URL is unset (default 4233)"),
    "nats_cluster": (int, ("nodes of the local nats-server: 3 runs a JetStream cluster on ports NATS_PORT to "
                          "NATS_PORT+2, every stream kept on each node (default 1)")),
    "database_url": (str, "SQLAlchemy async URL of the trace store (unset: SQLite in the data folder)"),
    "gateway_host": (str, "address the gateway listens on (default 127.0.0.1)"),
    "gateway_port": (int, "port the gateway listens on (default 8420)"),
    "gateway_url": (str, "where clients reach the gateway (unset: http://GATEWAY_HOST:GATEWAY_PORT)"),
    "gateway_max_body_bytes": (int, "largest request body the gateway reads; larger: 413 (default 33554432)"),
    "inference_host": (str, "address the inference API listens on (default 127.0.0.1)"),
    "inference_port": (int, "port the inference API listens on (default 8421)"),
    "torch_threads": (int, "threads torch may use in inference and trainer (default 1)"),
    "sandbox_backend": (str, "where the sandbox service runs code: local (bubblewrap) or docker (default local)"),
    "sandbox_image": (str, "Docker image of sandboxes, with python3 (default flywheel-sandbox:latest)"),
    "sandbox_max_alive": (int, "sandboxes one sandbox service holds at once (default 64)"),
    "sandbox_max_starting": (int, "sandboxes being started at once (default 4)"),
    "sandbox_warm_pool": (int, "sandboxes of the default spec kept started (default 4)"),
    "sandbox_allow_network": (str, "whether a sandbox may ask for network: true or false (off unless set)"),
    "run_lease_s": (float, "seconds a run outlives its orchestrator before another takes it over (default 60.0)"),
    "log_level": (str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
}
NATS_SETTINGS = ("nats_url", "nats_port", "nats_cluster")
GATEWAY_SETTINGS = ("gateway_host", "gateway_port", "gateway_url")


def add_settings(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    group = parser.add_argument_group("settings (override FLYWHEEL_* and FLYWHEEL_CONFIG)")
    for name in names:
        type_, help_ = SETTING_OPTIONS[name]
        # `flywheel up --cluster 3`: the one option also spelled shorter.
        spellings = ["--" + name.replace("_", "-")] + (["--cluster"] if name == "nats_cluster" else [])
        group.add_argument(*spellings, dest=name, type=type_, help=help_, metavar=name.upper())
    parser.set_defaults(setting_names=names)


def settings_from(args: argparse.Namespace) -> Any:
    """Settings with the given options on top; a bad value is a ValueError naming the setting."""
    from flywheel.contract.settings import Settings

    overrides = {name: getattr(args, name) for name in args.setting_names if getattr(args, name) is not None}
    return Settings.load(**overrides)
