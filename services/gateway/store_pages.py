"""Listings of the trace store, a page at a time: newest first, with a keyset cursor.

A listing pages newest first with a keyset cursor on ``seq`` (or its own order), so rows
recorded meanwhile never shift a page; a cursor names its listing, and one of a filtered listing
carries a digest of its filters (:func:`fingerprint`), so it cannot continue another listing
(:class:`InvalidCursor`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
import sqlalchemy as sa

from flywheel_gateway.store_db import StoreBase

MAX_PAGE_LIMIT = 1000


class InvalidCursor(ValueError):
    """A pagination cursor that this store did not hand out (or for another listing)."""


@dataclass
class Page:
    """One page of a listing; ``next_cursor`` is None on the last page."""

    items: list[dict[str, Any]]
    next_cursor: str | None


def fingerprint(filters: dict[str, Any]) -> str:
    """A short digest of a listing's filters (those set), carried in its cursors (see ``Store._page``)."""
    chosen = {k: v.astimezone(UTC) if isinstance(v, datetime) else v for k, v in sorted(filters.items())
              if v is not None}
    return hashlib.sha256(msgspec.json.encode(chosen)).hexdigest()[:16]


# Cursor keys as the database columns take them: seq is 64-bit, times are aware (UTC).
_Seq = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]


def encode_cursor(listing: str, *key: Any) -> str:
    """A cursor: the listing's name and the sort key of the last row handed out."""
    return base64.urlsafe_b64encode(msgspec.json.encode([listing, *key])).decode().rstrip("=")


def decode_cursor(listing: str, cursor: str, key_types: tuple[Any, ...] = (_Seq,)) -> tuple[Any, ...]:
    """The sort key in ``cursor``, typed by ``key_types``; InvalidCursor when it is not one of ``listing``'s."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        kind, *key = msgspec.json.decode(raw, type=list)
        if kind == listing:
            key_type = tuple[key_types]  # type: ignore[valid-type]  # a tuple type built at run time, for msgspec
            typed: tuple[Any, ...] = msgspec.convert(key, key_type)
            for value in typed:
                if isinstance(value, datetime):
                    value.astimezone(UTC)  # OverflowError outside years 1 to 9999 in UTC
            return typed
    except (binascii.Error, ValueError, TypeError, OverflowError, msgspec.DecodeError) as exc:
        raise InvalidCursor(f"cursor {cursor!r} is not a cursor this API handed out") from exc
    raise InvalidCursor(f"cursor {cursor!r} belongs to the {kind} listing, not {listing}")


def _before(order: Sequence[sa.Column[Any]], key: Sequence[Any]) -> sa.ColumnElement[bool]:
    """Rows after ``key`` in descending ``order``: (a, b) < (ka, kb), spelled out for every database."""
    column, value = order[0], key[0]
    if len(order) == 1:
        return column < value
    return sa.or_(column < value, sa.and_(column == value, _before(order[1:], key[1:])))


def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE_LIMIT}, got {limit}")


class PagedStore(StoreBase):
    """The paging the store's listings share."""

    async def _page(self, listing: str, table: sa.Table, columns: Sequence[sa.Column[Any]],
                    where: list[sa.ColumnElement[bool]], cursor: str | None, limit: int,
                    order: Sequence[sa.Column[Any]] = (), key_types: tuple[Any, ...] = (_Seq,),
                    scope: str | None = None) -> Page:
        """Newest first: descending ``order`` (default ``seq``), keyset on it, so rows recorded
        meanwhile never shift a page. ``key_types`` are the types of the ``order`` columns.
        ``scope`` (the filters' fingerprint) rides in the cursor: a cursor handed out under
        other filters is refused rather than continuing a different listing."""
        check_limit(limit)
        order = order or (table.c.seq,)
        if cursor is not None:
            key: Sequence[Any] = decode_cursor(listing, cursor, key_types + ((str,) if scope is not None else ()))
            if scope is not None:
                *key, cursor_scope = key
                if cursor_scope != scope:
                    raise InvalidCursor(f"cursor {cursor!r} continues a listing with other filters; pass the same "
                                        "filters as for the first page, or leave out the cursor to start over")
            where = [*where, _before(order, [self._text(k) if isinstance(k, str) else k for k in key])]
        shown = {c.name for c in columns}
        hidden = [c for c in order if c.name not in shown]
        query = (sa.select(*hidden, *columns).where(*where).order_by(*(c.desc() for c in order))
                 .limit(limit + 1))
        async with self.engine.connect() as conn:
            rows = [dict(row) for row in (await conn.execute(query)).mappings()]
        next_cursor = None
        if len(rows) > limit:
            last_key = [rows[limit - 1][c.name] for c in order]
            next_cursor = encode_cursor(listing, *last_key, *([scope] if scope is not None else []))
        items = rows[:limit]
        for row in items:
            for c in hidden:
                del row[c.name]
        return Page(items, next_cursor)
