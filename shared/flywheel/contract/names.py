"""What a name may be: a run id, a tenant, a NATS subject token. One rule each, stated as a
pattern (for JSON Schemas: the gateway's OpenAPI) and as a check whose message says what is
allowed; every producer and the gateway use these."""

from __future__ import annotations

import re

MAX_NAME_CHARS = 128
# Control characters (C0, DEL, C1) and every whitespace character (what Python's ``\s``
# matches), spelled out so that the pattern means the same as a JSON Schema (ECMA-262) regex,
# whose ``\s`` differs on a few characters; the ranges cover \t..\r, \x1c-\x1f, space, \x85, \xa0.
CONTROL_OR_SPACE = r"\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A NATS subject token: no separators, wildcards, whitespace or control characters (the
# server refuses some of those in subjects), not empty.
TOKEN_PATTERN = rf"^[^{CONTROL_OR_SPACE}.*>]+$"
_TOKEN = re.compile(TOKEN_PATTERN)
# A tenant is also a KV key (of the runs bucket's values, of the keys bucket), which allows fewer characters.
KEY_PATTERN = r"^[-/_=a-zA-Z0-9]+$"
_KV_KEY = re.compile(KEY_PATTERN)
# A run id names the run everywhere: a NATS subject token, a key of the runs bucket, a folder
# (:func:`path_name`); the same characters as a tenant, so a team may name runs ``team/name``.
RUN_ID_PATTERN = KEY_PATTERN
RUN_ID_RULE = (f"a run id is 1 to {MAX_NAME_CHARS} letters, digits, '-', '_', '/' or '=' (it names the run's "
               "subjects, its key in the runs bucket and its folder)")


def is_token(value: object) -> bool:
    """A NATS subject token of at most MAX_NAME_CHARS: no '.', '*', '>', whitespace or control
    characters, not empty."""
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None and len(value) <= MAX_NAME_CHARS


def is_key(value: object) -> bool:
    """A tenant (a key in the run state and the keys bucket): letters, digits, '-', '_', '/', '=', at
    most MAX_NAME_CHARS."""
    return isinstance(value, str) and _KV_KEY.fullmatch(value) is not None and len(value) <= MAX_NAME_CHARS


def is_run_id(value: object) -> bool:
    """A run id: letters, digits, '-', '_', '/' and '=', at most MAX_NAME_CHARS (see RUN_ID_PATTERN)."""
    return is_key(value)


def check_run_id(value: str, field: str = "run") -> str:
    """``value`` if it is a run id (the one rule, wherever a run id comes from), else a ValueError
    naming ``field``."""
    if not is_run_id(value):
        raise ValueError(f"{field}={value!r}: {RUN_ID_RULE}")
    return value


def check_token(field: str, value: str) -> str:
    """``value`` if it is a valid NATS subject token, else a ValueError naming ``field``."""
    if not is_token(value):
        raise ValueError(f"{field}={value!r} is not a valid NATS subject token: it must be 1 to {MAX_NAME_CHARS} "
                         "characters with no '.', '*', '>', whitespace or control characters")
    return value


def check_key(field: str, value: str) -> str:
    """``value`` if it can be a tenant, else a ValueError naming ``field``."""
    if not is_key(value):
        raise ValueError(f"{field}={value!r} must be 1 to {MAX_NAME_CHARS} letters, digits, '-', '_', '/' or '=' "
                         "(it is a NATS subject token and a key of the runs KV bucket)")
    return value


def path_name(run: str) -> str:
    """The run's id as a name of its own: of its folder, its files, its durables (NATS takes no
    '/' in a consumer's name): '/' as ``%2F`` (never a folder inside another run's; '%' is in no
    id, so two ids never share a name)."""
    return check_run_id(run).replace("/", "%2F")
