"""Alembic environment of the trace store.

Two ways in: :func:`flywheel_gateway.migrate.migrate` hands over a connection that is
already inside a locked write transaction (``config.attributes["connection"]``), which is
how the services migrate at start, from inside their event loop; the ``alembic`` command
line has none, so this module opens one the same way (``-x url=...``, else the Flywheel
settings) on a fresh event loop.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context

from flywheel_gateway.schema import metadata

config = context.config


def run_migrations(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        transactional_ddl=True,  # the caller holds the transaction (store.write_transaction)
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url_from_command_line() -> str:
    from flywheel.contract.settings import Settings

    return context.get_x_argument(as_dictionary=True).get("url") or Settings.load().resolved_database_url


if context.is_offline_mode():
    context.configure(url=_url_from_command_line(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    run_migrations(config.attributes["connection"])
else:
    from flywheel_gateway.migrate import run_exclusively

    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    asyncio.run(run_exclusively(_url_from_command_line(), run_migrations))
