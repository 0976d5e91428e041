"""Settings shared by every service and the CLI.

One name per setting, everywhere: ``FLYWHEEL_<NAME>`` in the environment, ``<name>`` in a
TOML file named by ``FLYWHEEL_CONFIG``, or the matching ``flywheel up`` option. Nothing
reads settings at import time: entry points build a :class:`Settings` and pass it on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="forbid")

    data_dir: Path = Field(Path(".flywheel"), description="Where the embedded stack keeps its state: NATS store, SQLite file, logs, run folders.")
    nats_url: str | None = Field(None, description="An existing NATS server with JetStream. Unset: `flywheel up` starts its own.")
    nats_port: int = Field(4233, description="Port of the nats-server that `flywheel up` starts (when nats_url is unset).")
    database_url: str | None = Field(None, description="SQLAlchemy async URL of the trace store. Unset: SQLite in data_dir.")
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8420
    gateway_url: str | None = Field(None, description="Where clients reach the gateway. Unset: http://gateway_host:gateway_port.")
    gateway_max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Largest request body the gateway "
                                        "reads; a larger one is refused with 413 (each task must also fit the bus's "
                                        "max payload).")
    inference_host: str = "127.0.0.1"
    inference_port: int = Field(8421, description="Port of the inference service's OpenAI-compatible API.")
    torch_threads: int | None = Field(
        1, description="Threads torch may use in inference and trainer processes. 1 suits one machine where they "
                       "share the cores (measured: several times faster than torch's default there); unset: torch decides.")
    sandbox_backend: Literal["local", "docker"] = Field(
        "local", description="Where the sandbox service runs code: local (bubblewrap) or docker (a Docker engine).")
    sandbox_image: str = Field("flywheel-sandbox:latest", description="Docker image of sandboxes (docker backend); "
                                                                    "it needs python3.")
    sandbox_max_alive: int = Field(64, ge=1, description="Sandboxes one sandbox service holds at once; more are refused.")
    sandbox_max_starting: int = Field(4, ge=1, description="Sandboxes being started at once; more wait.")
    sandbox_warm_pool: int = Field(4, ge=0, description="Sandboxes of the default spec kept started, for fast creates.")
    sandbox_allow_network: bool = Field(False, description="Whether a sandbox may ask for network (a spec with "
                                                           "network=true); off, such a request is refused.")
    run_lease_s: float = Field(60.0, gt=0, description="How long a run outlives its owner (`flywheel run`): past "
                                                       "this without a renewal the run is abandoned and its queued "
                                                       "tasks stop holding inference.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        import os

        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("FLYWHEEL_CONFIG")
        if config_file:
            if not Path(config_file).is_file():
                raise ValueError(f"FLYWHEEL_CONFIG={config_file!r}: no such file")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    @field_validator("nats_url")
    @classmethod
    def _check_nats_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"nats_url must start with nats://, tls://, ws:// or wss://, got {v!r}")
        return v

    @property
    def resolved_nats_url(self) -> str:
        return self.nats_url or f"nats://127.0.0.1:{self.nats_port}"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{(self.data_dir / 'flywheel.db').resolve()}"

    @property
    def resolved_gateway_url(self) -> str:
        return self.gateway_url or f"http://{self.gateway_host}:{self.gateway_port}"
