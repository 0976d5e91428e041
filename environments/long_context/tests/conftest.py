"""The fixture ``sandbox`` (tests/sandbox_fixtures.py) for long_context's tests: tests/conftest.py,
which registers it for the tests under tests/, does not reach the environments."""

from tests.sandbox_fixtures import sandbox

__all__ = ["sandbox"]
