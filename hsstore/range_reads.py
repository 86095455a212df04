"""Ranged reads of object-store files through obstore, an opt-in alternative to fsspec's.

Why: s3fs moves every response body through one asyncio event loop in Python (aiohttp's protocol
callbacks, a ``b"".join`` of the chunks), so one process reads S3 at what one core can parse: on the
project's 2-core VM, 712 MB/s from moto with the loop's thread at 100%. obstore (Rust, the
``object_store`` crate) does the HTTP work outside the GIL and hands back one buffer: the same ranged
GETs from 4 threads moved 1,423 MB/s against s3fs's 917, at less than half the client CPU
(benchmarks/RESULTS.md, issue 16).

Opt-in with ``HSSTORE_RANGE_READER=obstore`` (read when a :class:`~hsstore.location.StoreLocation`
is built, so Ray workers and DataLoader processes need it in their environment too). Only the
loader's ranged reads of shard files take this path; metadata, manifests and every write stay on
fsspec (and its conditional PUTs). Credentials and endpoint come from the same places s3fs takes
them: the location's ``storage_options`` (``key``, ``secret``, ``token``, ``endpoint_url``,
``client_kwargs: {endpoint_url, region_name}``) or the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). An option this mapping does not know is an
error, not silently dropped: a dropped endpoint would read another bucket of the same name.
Credentials only in ``~/.aws`` profiles are not read by obstore: export them, or stay on fsspec.
"""

from __future__ import annotations

import os
import threading
from typing import Any

ENV_VAR = "HSSTORE_RANGE_READER"
READERS = ("fsspec", "obstore")
# s3fs storage options this module maps onto obstore's S3 config; anything else is refused.
_S3_OPTIONS = {"key", "secret", "token", "endpoint_url", "client_kwargs", "anon"}


def configured_reader() -> str:
    """The reader the environment asks for (``fsspec`` when unset)."""
    reader = os.environ.get(ENV_VAR, "fsspec").strip().lower() or "fsspec"
    if reader not in READERS:
        raise ValueError(f"{ENV_VAR}={reader!r}: expected one of {', '.join(READERS)}")
    return reader


class ObstoreRangeReader:
    """``read(path, start, end)`` for ``bucket/key`` paths of one S3 location, one store per bucket.
    The caller checks that the location is on S3 (StoreLocation does, from fsspec's protocol)."""

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.config = _s3_config(url, storage_options)
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                config: Any = dict(self.config)
                client_options: Any = {"allow_http": True} if str(config.get("endpoint", "")).startswith("http://") else {}
                store = S3Store(bucket, config=config, client_options=client_options)
                self._stores[bucket] = store
            return store

    def read(self, path: str, start: int, end: int) -> memoryview:
        import obstore

        bucket, _, key = path.partition("/")
        return memoryview(obstore.get_range(self._store(bucket), key, start=start, end=end))


def _s3_config(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(storage_options) - _S3_OPTIONS
    client_kwargs = dict(storage_options.get("client_kwargs") or {})
    unknown |= {f"client_kwargs.{k}" for k in set(client_kwargs) - {"endpoint_url", "region_name"}}
    if unknown:
        raise ValueError(
            f"{url}: {ENV_VAR}=obstore cannot map the storage option(s) {sorted(unknown)}; "
            f"unset {ENV_VAR} to read through fsspec"
        )
    env = os.environ
    config: dict[str, Any] = {}
    endpoint = (
        storage_options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        config["endpoint"] = endpoint
    region = client_kwargs.get("region_name") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        config["region"] = region
    if storage_options.get("anon"):
        config["skip_signature"] = True
    for option, name, variable in (
        ("key", "access_key_id", "AWS_ACCESS_KEY_ID"),
        ("secret", "secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("token", "session_token", "AWS_SESSION_TOKEN"),
    ):
        value = storage_options.get(option) or env.get(variable)
        if value:
            config[name] = value
    return config
