"""Test suites that ship with hsstore, for code built on it (as zarr ships ``zarr.testing``).

:class:`StoreTests` is the contract of a storage backend: subclass it in a pytest module, give it a
``location`` fixture that yields a fresh, empty :class:`~hsstore.storage.StoreLocation` of the
backend under test, and every check runs against that backend::

    class TestMyBackend(StoreTests):
        @pytest.fixture
        def location(self, tmp_path):
            yield MyBackend(f"my://{tmp_path}")

hsstore runs it on local paths, ``file://``, ``memory://`` and S3 (moto on loopback) in
``tests/hsstore/test_store.py``. Needs pytest (not a dependency of the store library).
"""

from hsstore.testing.store import StoreTests

__all__ = ["StoreTests"]
