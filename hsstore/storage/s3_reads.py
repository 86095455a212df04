"""Ranged reads of S3 shard files through obstore: the loader's default reader on ``s3://``.

Why: s3fs moves every response body through one asyncio event loop in Python (aiohttp's protocol
callbacks, a ``b"".join`` of the chunks), so one process reads S3 at what one core can parse: on the
GPU machine's 16 cores, 0.09x of a local page-cached read against moto, where obstore (Rust, the
``object_store`` crate, the HTTP work outside the GIL, one buffer handed back) reads 0.31x with the
same loader settings, in the same run (benchmarks/RESULTS.md, issue 16).

Which reader (``HSSTORE_RANGE_READER``, read when a :class:`~hsstore.storage.StoreLocation` is
built, so Ray workers and DataLoader processes take it from their own environment):

- ``auto`` (unset): obstore for ``s3://`` stores when it is installed (``hsstore[s3]``) and every
  storage option maps onto it; fsspec otherwise (``gs://``, other protocols, an option it lacks);
- ``obstore``: obstore or an error saying why not (another protocol, an option it cannot map);
- ``fsspec``: fsspec's ``cat_file`` everywhere.

Only the loader's ranged reads of shard files take this path; metadata, manifests and every write
stay on fsspec (and its conditional PUTs). What obstore is given, so that it reads what s3fs would:

- endpoint, keys, ``anon``: the location's ``storage_options`` (``key``, ``secret``, ``token``,
  ``endpoint_url``, ``anon``, ``profile``, ``client_kwargs: {endpoint_url, region_name}``) or the
  standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Keys found nowhere
  there come from botocore's credential chain (``~/.aws`` profiles, SSO, assumed roles, instance
  and container roles), refreshed as botocore refreshes them.
- region: ``client_kwargs.region_name`` if given, else the bucket's own, asked once per bucket
  (HEAD bucket, the ``x-amz-bucket-region`` header, as s3fs's region cache does), else the
  environment's or profile's. botocore follows a wrong region's redirect; object_store does not.
- errors: a missing file is ``FileNotFoundError``, a refused one ``PermissionError``, any other
  failure ``OSError``, each naming the path (what the loader's ``skip_corrupt`` counts).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from hsstore.errors import botocore_responses
from hsstore.read_cache import OnFilled, Scatter

logger = logging.getLogger(__name__)

ENV_VAR = "HSSTORE_RANGE_READER"
READERS = ("auto", "fsspec", "obstore")
# s3fs storage options this module maps onto obstore's S3 config; anything else is refused.
_S3_OPTIONS = {"key", "secret", "token", "endpoint_url", "client_kwargs", "anon", "profile"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
# How long obstore keeps credentials from botocore before asking again: botocore itself refreshes
# temporary credentials well before they expire (15 minutes ahead), so asking every 5 is enough.
CREDENTIALS_TTL = timedelta(minutes=5)
# A streamed GET body is copied into place in pieces of at least this size: large enough that the
# per-piece Python work is small against the copy, small enough to stay in the CPU's cache.
STREAM_PIECE_BYTES = 1 << 20
# How the loader's GET bodies reach the batch (``HSSTORE_S3_BODY``, read when a reader is built):
# ``whole``: the body received by obstore outside the GIL; the array reader takes it (``read``,
# ``S3Backend.bodies_arrive_whole``), checks each chunk in it and copies it into place; ``stream``:
# copied piece by piece as it arrives (no whole-range buffer, ~15% less CPU per GB, but one GIL
# round trip per piece). On the 16-core GPU host at 20 ms, 32 bare GETs in flight moved 261k
# tokens/s whole against 135k streamed (benchmarks/RESULTS.md, issue 32): ``whole`` by default.
BODY_ENV_VAR = "HSSTORE_S3_BODY"
BODIES = ("whole", "stream")


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name``, one of ``choices`` (the first when unset or empty)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def configured_body() -> str:
    """The body handling the environment asks for (``whole`` when unset)."""
    return _env_choice(BODY_ENV_VAR, BODIES)


def configured_reader() -> str:
    """The reader the environment asks for (``auto`` when unset)."""
    return _env_choice(ENV_VAR, READERS)


def remote_range_reader(url: str, storage_options: dict[str, Any], *, on_s3: bool, fs: Any) -> ObstoreRangeReader | None:
    """The reader for a store at ``url`` (not a local one): obstore's, or None for fsspec's."""
    reader = configured_reader()
    if reader == "fsspec":
        return None
    if reader == "obstore":
        if not on_s3:
            raise ValueError(f"{url}: {ENV_VAR}=obstore reads s3:// stores only")
        return ObstoreRangeReader(url, storage_options, fs)
    if not on_s3 or importlib.util.find_spec("obstore") is None or _unmapped(storage_options):
        return None
    return ObstoreRangeReader(url, storage_options, fs)


class ObstoreRangeReader:
    """``read(path, start, end)`` for ``bucket/key`` paths of one S3 location, one store per bucket.

    ``fs``: the location's s3fs filesystem, used once per bucket to ask for its region (None: no
    asking, the configured region or obstore's default).
    """

    def __init__(self, url: str, storage_options: dict[str, Any], fs: Any = None):
        unmapped = _unmapped(storage_options)
        if unmapped:
            raise ValueError(
                f"{url}: {ENV_VAR}=obstore cannot map the storage option(s) {unmapped}; "
                f"set {ENV_VAR}=fsspec to read through fsspec"
            )
        self.url = url
        self.storage_options = dict(storage_options)
        self.fs = fs
        self.config = _s3_config(storage_options)
        self.body = configured_body()
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = self._open(bucket)
            return store

    def _open(self, bucket: str) -> Any:
        import botocore.session
        from obstore.store import S3Store

        config: Any = dict(self.config)
        session = botocore.session.Session(profile=self.storage_options.get("profile"))
        provider: Any = None
        if "access_key_id" not in config and not config.get("skip_signature"):
            credentials = session.get_credentials()  # None: obstore tries its own chain (instance metadata)
            provider = _BotocoreCredentials(credentials) if credentials is not None else None
        if "region" not in config:  # not given explicitly: the bucket's own, else the environment's or profile's
            region = _bucket_region(self.fs, bucket) or session.get_config_variable("region")
            if region:
                config["region"] = region
        client_options: Any = {"allow_http": True} if str(config.get("endpoint", "")).startswith("http://") else {}
        logger.debug("obstore reads s3://%s (region %s)", bucket, config.get("region", "default"))
        return S3Store(bucket, config=config, client_options=client_options, credential_provider=provider)

    def read(self, path: str, start: int, end: int) -> memoryview:
        import obstore

        bucket, _, key = path.partition("/")
        with _named_errors(path, start, end):
            return memoryview(obstore.get_range(self._store(bucket), key, start=start, end=end))

    def read_into(self, path: str, start: int, buffers: list[Any], on_filled: OnFilled | None = None) -> int:
        """The bytes from ``start`` over the writable ``buffers``, one after another; returns how
        many bytes came (fewer than the buffers hold: the object ended). ``on_filled(i)``: called
        as the copy fills buffer ``i`` (:class:`~hsstore.read_cache.Scatter`), so with either body
        the caller's check of each buffer follows its copy while it is in cache. ``self.body`` (see
        :data:`BODY_ENV_VAR`): ``whole`` receives the body outside the GIL and copies it once;
        ``stream`` copies it as it arrives (pieces of :data:`STREAM_PIECE_BYTES`), building no
        buffer of the whole range (that copy and the page faults of a fresh ~10 MB buffer per GET
        were a third of the loader's CPU time per byte on the 2-core VM), at one GIL round trip per
        piece, which many reader threads queue on (benchmarks/RESULTS.md, issue 32)."""
        import obstore

        filler = Scatter(buffers, on_filled)
        if not filler.nbytes:
            filler.write(b"")  # no GET for nothing: only its empty buffers to report
            return 0
        bucket, _, key = path.partition("/")
        end = start + filler.nbytes
        with _named_errors(path, start, end):
            result = obstore.get(self._store(bucket), key, options={"range": (start, end)})
            body = memoryview(result.bytes()) if self.body == "whole" else None
            if body is None:
                for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                    filler.write(piece)
        if body is not None:  # copied outside _named_errors: what on_filled raises is no GET error
            filler.write(body)
        return filler.received


@contextlib.contextmanager
def _named_errors(path: str, start: int, end: int) -> Iterator[None]:
    """obstore's errors as the builtins the loader handles, naming the file."""
    from obstore.exceptions import (
        BaseError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    try:
        yield
    except (FileNotFoundError, NotFoundError) as err:  # obstore raises the builtin for a 404
        raise FileNotFoundError(f"s3://{path}: not found ({_first_line(err)})") from err
    except (PermissionError, PermissionDeniedError, UnauthenticatedError) as err:
        raise PermissionError(f"s3://{path}: access refused ({_first_line(err)})") from err
    except BaseError as err:
        raise OSError(f"s3://{path}: bytes {start}-{end} not read: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    """obstore's message without the debug dump it appends (the response body, the retry state)."""
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


def _unmapped(storage_options: dict[str, Any]) -> list[str]:
    """The storage options obstore would not be given (sorted, ``client_kwargs.x`` for nested ones)."""
    unknown = set(storage_options) - _S3_OPTIONS
    unknown |= {f"client_kwargs.{k}" for k in set(storage_options.get("client_kwargs") or {}) - _CLIENT_KWARGS}
    return sorted(unknown)


def _s3_config(storage_options: dict[str, Any]) -> dict[str, Any]:
    """obstore's S3 config from the options and the environment (a region only when given explicitly)."""
    env = os.environ
    client_kwargs = dict(storage_options.get("client_kwargs") or {})
    config: dict[str, Any] = {}
    endpoint = (
        storage_options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        config["endpoint"] = endpoint
    if client_kwargs.get("region_name"):
        config["region"] = client_kwargs["region_name"]
    if storage_options.get("anon"):
        config["skip_signature"] = True
    for option, name, variable in (
        ("key", "access_key_id", "AWS_ACCESS_KEY_ID"),
        ("secret", "secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("token", "session_token", "AWS_SESSION_TOKEN"),
    ):
        # A profile named in the options means its keys, not the environment's.
        value = storage_options.get(option) or (None if storage_options.get("profile") else env.get(variable))
        if value:
            config[name] = value
    return config


class _BotocoreCredentials:
    """obstore's credential callback over botocore's credentials (static or refreshing)."""

    def __init__(self, credentials: Any):
        self.credentials = credentials

    def __call__(self) -> dict[str, Any]:
        frozen = self.credentials.get_frozen_credentials()  # refreshes temporary ones when due
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + CREDENTIALS_TTL,
        }


def _bucket_region(fs: Any, bucket: str) -> str | None:
    """The region the bucket says it is in (HEAD bucket through the location's s3fs client; a 403
    still carries the header), or None where it cannot be asked or does not say."""
    if fs is None or not hasattr(fs, "call_s3"):
        return None
    try:
        response = fs.call_s3("head_bucket", Bucket=bucket)
    except Exception as err:  # any failure: look for the header on the error, else go without
        response = next(botocore_responses(err), {})
        if not response:
            logger.debug("no region for s3://%s from HEAD bucket: %s", bucket, err)
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    return response.get("BucketRegion") or headers.get("x-amz-bucket-region")
