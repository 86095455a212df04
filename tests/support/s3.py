"""The one S3 endpoint of the tests and benchmarks: moto's S3 server on loopback, in its own
process, counting the HTTP requests it serves (tests/conftest.py's ``s3_server`` fixture is one
per session).

The object-store benchmark and tests need an S3-compatible endpoint (no network here) and the number
of requests a loader really sends. moto's ``ThreadedMotoServer`` runs in the caller's process and
so shares its GIL with the loader being measured; this runs the same WSGI app
(``DomainDispatcherApplication``) in a child process instead, as a real endpoint would be, wrapped in
a middleware that counts requests by method (and the bytes of response bodies). By default it also
stops moto from copying a whole object to answer a ranged GET (``fast_ranges``, see
:func:`_serve_ranges_without_copying_objects`), which S3 does not do. The counts are read
(and reset) through ``GET /__hsstore_requests``, a path no S3 client sends.

    with MotoS3() as s3:
        s3.environ()           # {"AWS_ENDPOINT_URL": ..., dummy keys}: what s3fs/botocore read
        s3.requests(reset=True)

One moto process answers every request in Python under one GIL: it, not the client, sets the pace
of a fast reader (RESULTS.md, "On 16 idle cores"). A real S3 endpoint scales with connections.
``MotoS3(processes=N)`` comes closer: once the objects are written, :meth:`MotoS3.freeze` forks the
server into N processes that accept on the same listening socket, each with a copy-on-write copy of
moto's state. From then on the endpoint is read-only (a write would reach one copy only, so it is
refused with 405 and a message saying why), and the request counts are kept in shared memory across
the N processes. The objects are kept in memory, not in moto's spill files (whose file offsets the
forked processes would share).

``MotoS3(latency_ms=L)`` or :meth:`MotoS3.set_latency` makes every S3 request wait L ms (a distant
endpoint's first-byte latency; all processes of a frozen endpoint share the setting), and
:meth:`MotoS3.load` puts a local folder's files into a bucket from the server process itself, which
takes seconds where an upload through the endpoint's multipart requests took minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT

COUNTS_PATH = "/__hsstore_requests"
FREEZE_PATH = "/__hsstore_freeze"  # POST ?processes=N: fork into N read-only server processes
LATENCY_PATH = "/__hsstore_latency"  # POST ?ms=X: the wait added to every S3 request from now on
LOAD_PATH = "/__hsstore_load"  # POST ?folder=...&bucket=...&prefix=...: put a local folder's files, server side
# What the counters count (shared memory: the forked processes add to the same slots).
COUNTED = ("GET", "HEAD", "PUT", "POST", "DELETE", "other", "GET_ranged", "response_bytes")
READ_METHODS = {"GET", "HEAD"}
# Dummy credentials for the loopback endpoint only; never a real account.
DUMMY_KEYS = {
    "AWS_ACCESS_KEY_ID": "hsstore-test",
    "AWS_SECRET_ACCESS_KEY": "hsstore-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _Counting:
    """WSGI middleware: counts requests per method and the bytes sent back, in shared memory so
    that the processes of a frozen endpoint (MotoS3.freeze) count together; answers the count and
    freeze paths; refuses writes once frozen."""

    def __init__(self, app: Any, latency: _FirstByteLatency):
        import multiprocessing

        self.app = app
        self.latency = latency
        self.counts = multiprocessing.get_context("fork").Array("q", len(COUNTED))  # with its lock
        self.freeze_to: int = 0  # set by a freeze request: the processes to fork into
        self.frozen = False
        self.on_freeze: Any = None  # the server's shutdown, set by serve()

    def add(self, **amounts: int) -> None:
        with self.counts.get_lock():
            for name, amount in amounts.items():
                self.counts[COUNTED.index(name)] += amount

    def snapshot(self, reset: bool) -> dict[str, int]:
        with self.counts.get_lock():
            values = dict(zip(COUNTED, self.counts[:], strict=True))
            if reset:
                self.counts[:] = [0] * len(COUNTED)
        return {name: value for name, value in values.items() if value}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO")
        method = environ.get("REQUEST_METHOD", "?")
        if path == COUNTS_PATH:
            return _answer(start_response, "200 OK", json.dumps(self.snapshot("reset" in environ.get("QUERY_STRING", ""))))
        if path == FREEZE_PATH and method == "POST":
            processes = int(environ.get("QUERY_STRING", "processes=1").partition("processes=")[2] or 1)
            if not self.frozen and processes > 1:
                self.freeze_to = processes
                threading.Thread(target=self.on_freeze, daemon=True).start()  # serve_forever returns
            return _answer(start_response, "200 OK", json.dumps({"processes": processes}))
        if path == LATENCY_PATH and method == "POST":
            query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
            self.latency.seconds.value = float(query["ms"][0]) / 1000.0
            return _answer(start_response, "200 OK", json.dumps({"latency_ms": float(query["ms"][0])}))
        if path == LOAD_PATH and method == "POST" and not self.frozen:
            query = {k: v[0] for k, v in urllib.parse.parse_qs(environ.get("QUERY_STRING", "")).items()}
            loaded = _load_folder(Path(query["folder"]), query["bucket"], query.get("prefix", ""))
            return _answer(start_response, "200 OK", json.dumps(loaded))
        if self.frozen and method not in READ_METHODS:
            return _answer(
                start_response, "405 Method Not Allowed",
                f"{method} refused: this moto endpoint was frozen into several read-only processes "
                "(tests/support/s3.py, MotoS3.freeze); each holds its own copy of the objects, so a "
                "write would reach one of them only. Write everything before freeze().",
            )
        self.add(**{method if method in COUNTED else "other": 1}, GET_ranged=int("HTTP_RANGE" in environ))
        chunks = self.app(environ, start_response)
        sent = 0
        out = []
        for chunk in chunks:
            sent += len(chunk)
            out.append(chunk)
        self.add(response_bytes=sent)
        return out


class _FirstByteLatency:
    """WSGI middleware: every S3 request waits ``seconds`` before moto answers it, as the first
    byte of a distant endpoint's answer arrives late. A sleep, not work: requests on other
    connections (the server runs a thread per connection) wait at the same time. The wait is
    shared memory, so that :meth:`MotoS3.set_latency` reaches every process of a frozen endpoint."""

    def __init__(self, app: Any, seconds: float):
        import multiprocessing

        self.app = app
        self.seconds = multiprocessing.get_context("fork").Value("d", seconds, lock=False)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if self.seconds.value > 0:
            time.sleep(self.seconds.value)
        return self.app(environ, start_response)


def _load_folder(folder: Path, bucket: str, prefix: str) -> dict[str, int]:
    """Put every file under ``folder`` into ``bucket`` as ``prefix/<relative path>``, in this (the
    server's) process through moto's backend: what an upload through the endpoint stores, without
    its multipart requests (an upload of a 1.6 GB store took 70 s on 2 cores, all of it moto's
    request handling)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    if bucket not in backend.buckets:
        backend.create_bucket(bucket, DUMMY_KEYS["AWS_DEFAULT_REGION"])
    files = nbytes = 0
    keys = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = "/".join(part for part in (prefix, path.relative_to(folder).as_posix()) if part)
        data = path.read_bytes()
        keys.append(backend.put_object(bucket, key, data))
        files, nbytes = files + 1, nbytes + len(data)
    # moto computes an object's ETag (the md5 of all of it) at its first GET and keeps it in the
    # process: after a freeze each forked process computed it again at its first read of each
    # object, ~0.4 s per 200 MB shard file, so a benchmark's first timed run after a freeze paid
    # it (8 processes on the 16-core hosts: the first loader run read at a third of the later
    # ones; LOG, 2026-12-05). Computed here, before any fork, on every core (hashlib releases the
    # GIL), every process inherits them.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda key: key.etag, keys))
    return {"files": files, "bytes": nbytes}


def _answer(start_response: Any, status: str, text: str) -> list[bytes]:
    body = text.encode()
    kind = "application/json" if status.startswith("200") else "text/plain"
    start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body)))])
    return [body]


class _RangeOfKey:
    """What a ranged GET hands to moto's range handling instead of the whole object's bytes: its
    length, and slices read from the object's buffer on demand."""

    def __init__(self, key: Any):
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return bytes(self.key._value_buffer.read(max(0, stop - start)))


def _serve_ranges_without_copying_objects() -> None:
    """moto (5.x) answers a ranged GET by reading and copying the whole object (``FakeKey.value``),
    then slicing: a 1 MB range of a 100 MB shard file costs 200 MB of copies in the server, which S3
    does not pay. Within ``get_object`` of a request with a Range header, ``FakeKey.value`` returns a
    lazy view instead, so the range handling reads only the requested bytes. Everything else (auth,
    headers, ETags, errors, the 206/416 logic) is moto's own code."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    state = threading.local()
    plain_value = FakeKey.value

    def value(self: Any) -> Any:
        if getattr(state, "ranged", False):
            return _RangeOfKey(self)
        return plain_value.fget(self)  # type: ignore[attr-defined]

    FakeKey.value = property(value, plain_value.fset)  # type: ignore[method-assign,assignment]
    plain_get_object = S3Response.get_object

    def get_object(self: Any) -> Any:
        state.ranged = bool(self.headers.get("range"))
        try:
            return plain_get_object(self)
        finally:
            state.ranged = False

    S3Response.get_object = get_object  # type: ignore[method-assign]


def serve(port: int, fast_ranges: bool = True, latency_ms: float = 0.0) -> None:
    """The child process: moto's app behind the counting middleware, threaded like moto's own
    server; after a freeze request, the same listening socket served by N forked processes."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if fast_ranges:
        _serve_ranges_without_copying_objects()
    latency = _FirstByteLatency(DomainDispatcherApplication(create_backend_app), latency_ms / 1000.0)
    app = _Counting(latency, latency)  # the count, freeze, latency and load paths answer at once
    server = make_server("127.0.0.1", port, app, threaded=True)
    app.on_freeze = server.shutdown
    print("ready", flush=True)
    # socketserver's loop, not werkzeug's serve_forever: that one closes the socket when it returns.
    socketserver.BaseServer.serve_forever(server)
    if not app.freeze_to:
        return
    app.frozen = True
    # Every process accepts on the one socket; non-blocking, so that one that loses the race for
    # a connection goes back to waiting instead of blocking in accept().
    server.socket.setblocking(False)
    for _ in range(app.freeze_to - 1):
        if os.fork() == 0:
            break  # a child: serves below, as the parent does
    socketserver.BaseServer.serve_forever(server)


class MotoS3:
    """A moto S3 server on 127.0.0.1 in a child process; a context manager."""

    def __init__(self, fast_ranges: bool = True, processes: int = 1, latency_ms: float = 0.0) -> None:
        """``processes`` > 1: :meth:`freeze` forks the server into that many read-only processes.
        ``latency_ms`` > 0: every S3 request waits that long before it is answered (a distant
        endpoint's first-byte latency; loopback has none)."""
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        self.latency_ms = latency_ms
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.fast_ranges = fast_ranges
        self.processes = processes
        self.frozen = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([_repo_root(), os.environ.get("PYTHONPATH", "")])}
        if self.processes > 1:
            # Objects in memory (copy-on-write after the fork), never in spill files whose file
            # offsets the forked processes would share.
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 50)
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import tests.support.s3 as m; m.serve({self.port}, {self.fast_ranges}, {self.latency_ms})"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: stop() ends the forked processes too
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"moto S3 server did not start (printed {line!r})")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.requests()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto S3 server on port {self.port} does not answer")

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)  # the server and any forked copies
            self.process.wait(timeout=10)
            self.process = None
        # fsspec caches filesystems by their arguments, not by the AWS_* environment that pointed them
        # here: drop them, or the next server's users (a later test) get one bound to this dead port.
        with contextlib.suppress(ImportError):
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()

    def freeze(self) -> MotoS3:
        """Fork the server into ``processes`` read-only processes (a no-op for one): call it once
        every object is written. Later writes are refused (405)."""
        if self.processes == 1 or self.frozen:
            return self
        self._control(f"{FREEZE_PATH}?processes={self.processes}")
        self.frozen = True
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the forked processes answer on the same port
            try:
                self.requests()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"moto S3 server on port {self.port} does not answer after the freeze")

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def set_latency(self, latency_ms: float) -> MotoS3:
        """Every S3 request from now on waits ``latency_ms`` (all processes of a frozen endpoint
        too): e.g. a store uploaded at loopback speed, then read at a cloud store's latency."""
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        self._control(f"{LATENCY_PATH}?ms={latency_ms}")
        self.latency_ms = latency_ms
        return self

    def load(self, folder: Path | str, url: str) -> dict[str, int]:
        """Put the files of the local ``folder`` (a store) at ``s3://bucket/prefix``, creating the
        bucket if needed: :func:`upload`'s result, written by the server process itself from this
        machine's disk (no requests per file). Before :meth:`freeze` only."""
        if self.frozen:
            raise RuntimeError("load() before freeze(): a frozen endpoint takes no writes")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        query = urllib.parse.urlencode({"folder": str(Path(folder).resolve()), "bucket": bucket, "prefix": prefix.strip("/")})
        return {key: int(value) for key, value in json.loads(self._control(f"{LOAD_PATH}?{query}")).items()}

    def _control(self, path_and_query: str) -> bytes:
        request = urllib.request.Request(f"{self.endpoint}{path_and_query}", method="POST")
        with urllib.request.urlopen(request, timeout=600) as response:  # noqa: S310 - loopback only
            return bytes(response.read())

    def environ(self) -> dict[str, str]:
        """The standard AWS environment that points s3fs/botocore at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **DUMMY_KEYS}

    def export(self) -> None:
        """Point this process at the server: its :meth:`environ` into ``os.environ``, and s3fs's
        cached filesystems dropped. fsspec hands out one instance per set of options, and botocore
        read the endpoint variable when that instance's client was built: a script (or a test run
        after another) that used another endpoint in this process would otherwise write through the
        old endpoint while obstore, which reads the variables at every open, reads the new one."""
        os.environ.update(self.environ())
        try:
            import s3fs
        except ImportError:
            return
        s3fs.S3FileSystem.clear_instance_cache()

    def requests(self, reset: bool = False) -> dict[str, int]:
        """Requests served since the last reset, by method (plus ``GET_ranged`` and ``response_bytes``)."""
        url = self.endpoint + COUNTS_PATH + ("?reset=1" if reset else "")
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback only
            return {key: int(value) for key, value in json.loads(response.read()).items()}


def _repo_root() -> str:
    return str(REPO_ROOT)


def upload(local: Path | str, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Copy a local folder (a store) to ``s3://bucket/prefix``, creating the bucket if needed."""
    import s3fs

    fs = s3fs.S3FileSystem(**(storage_options or {}))
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.put(str(local), url.removeprefix("s3://"), recursive=True)
