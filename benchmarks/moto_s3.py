"""moto's S3 server on loopback, in its own process, counting the HTTP requests it serves.

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
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from typing import Any

COUNTS_PATH = "/__hsstore_requests"
# Dummy credentials for the loopback endpoint only; never a real account.
DUMMY_KEYS = {
    "AWS_ACCESS_KEY_ID": "hsstore-test",
    "AWS_SECRET_ACCESS_KEY": "hsstore-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _Counting:
    """WSGI middleware: counts requests per method and the bytes sent back."""

    def __init__(self, app: Any):
        self.app = app
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                body = json.dumps(dict(self.counts)).encode()
                if "reset" in environ.get("QUERY_STRING", ""):
                    self.counts.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        method = environ.get("REQUEST_METHOD", "?")
        ranged = "HTTP_RANGE" in environ
        with self.lock:
            self.counts[method] += 1
            if ranged:
                self.counts["GET_ranged"] += 1
        chunks = self.app(environ, start_response)
        sent = 0
        out = []
        for chunk in chunks:
            sent += len(chunk)
            out.append(chunk)
        with self.lock:
            self.counts["response_bytes"] += sent
        return out


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


def serve(port: int, fast_ranges: bool = True) -> None:
    """The child process: moto's app behind the counting middleware, threaded like moto's own server."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if fast_ranges:
        _serve_ranges_without_copying_objects()
    app = _Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, app, threaded=True)
    print("ready", flush=True)
    server.serve_forever()


class MotoS3:
    """A moto S3 server on 127.0.0.1 in a child process; a context manager."""

    def __init__(self, fast_ranges: bool = True) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.fast_ranges = fast_ranges

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import benchmarks.moto_s3 as m; m.serve({self.port}, {self.fast_ranges})"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([_repo_root(), os.environ.get("PYTHONPATH", "")])},
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
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def environ(self) -> dict[str, str]:
        """The standard AWS environment that points s3fs/botocore at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **DUMMY_KEYS}

    def requests(self, reset: bool = False) -> dict[str, int]:
        """Requests served since the last reset, by method (plus ``GET_ranged`` and ``response_bytes``)."""
        url = self.endpoint + COUNTS_PATH + ("?reset=1" if reset else "")
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback only
            return {key: int(value) for key, value in json.loads(response.read()).items()}


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
