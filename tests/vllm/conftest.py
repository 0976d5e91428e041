"""The vLLM tier: tests marked ``vllm`` need the vllm package, which lives in .venv-vllm
(``scripts/test.sh --vllm``). Elsewhere they skip, saying so."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so the tier runs under --strict-markers before pyproject lists it.
    config.addinivalue_line("markers", "vllm: needs vLLM (.venv-vllm), run with scripts/test.sh --vllm")
