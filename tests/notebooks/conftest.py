from __future__ import annotations

import pytest

from tests.pipelines.sweep.helpers import shared_tiny_store


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_store(tmp_path_factory)
