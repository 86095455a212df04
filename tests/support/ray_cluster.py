"""A real multi-node Ray cluster on this machine: ``ray start --head`` plus worker nodes, each its own
``ray start --address ...`` (its own raylet, object store and worker processes), as on separate
machines. For the cluster tests (tests/reliability/test_ray_cluster.py) and the cluster benchmark
(``python -m benchmarks.bench_extract cluster``, benchmarks/extract/cluster.py).

Kept light and private to its caller: a temp folder and ports of its own (so two test sessions on
one machine never join each other's cluster), no dashboard, small object stores. Every node runs
``ray start --block`` in its own process group, so :meth:`LocalRayCluster.kill_node` SIGKILLs a
node's raylet and every worker process under it at once, as a machine losing power would, and
:meth:`LocalRayCluster.stop` leaves nothing behind.

    with LocalRayCluster(Path("/tmp/x"), env=s3.environ()) as cluster:
        cluster.add_nodes(2, num_cpus=2, resources={"extract_node": 2})
        recipe.ray.address = cluster.address
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT

# The head runs the GCS and the driver; it has a CPU but no ``extract_node`` resource, so that the
# recipe's ``ray.resources_per_worker``, not a lack of room, is what keeps actors off it.
HEAD_NUM_CPUS = 1
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # ShardRecords are all that travels through it
START_TIMEOUT_S = 90.0
# A raylet starts one idle Python worker per CPU when it starts and again when the first driver
# connects; the tests' actors seldom take them, and each costs ~0.4 CPU-s of imports on a 2-core
# machine. Off for every Ray the tests start (tests/conftest.py sets it for the whole run) and
# every node of a cluster here.
RAY_LEAN_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


class ClusterError(RuntimeError):
    """A node did not start, or did not join the cluster in time."""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback (held open together, so no repeats)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class RayNode:
    """One ``ray start --block`` process (the leader of its process group) and its arguments."""

    name: str
    args: list[str]
    process: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalRayCluster:
    """Head plus worker nodes on one machine; see the module docstring."""

    def __init__(self, root: Path, *, env: dict[str, str] | None = None) -> None:
        # Unix socket paths must stay under ~107 bytes: a short temp folder of our own.
        self.root = Path(root)
        self._token = secrets.token_hex(32)
        self.root.mkdir(parents=True, exist_ok=True)
        self.temp_dir = self.root / "ray"
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            # A node SIGKILLed is declared dead after 8 failed health checks 1 s apart (default:
            # 5 of 3 s); not fewer: on a busy shared machine a live raylet may answer late.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "8",
            # A raylet registering with a busy GCS may take longer than the default 30 s.
            "RAY_raylet_start_wait_time_s": "120",
            **RAY_LEAN_ENV,
            **(env or {}),
            **self.auth_env(),
        }
        self.gcs_port = _free_ports(1)[0]
        self.nodes: list[RayNode] = []
        self._probe: _NodeProbe | None = None

    def auth_env(self) -> dict[str, str]:
        """What every node and every driver of this cluster needs in its environment: Ray (2.5x)
        turns token authentication on by default, and a process without the token is refused by
        the GCS. A token of this cluster's own, not the machine's ``~/.ray/auth_token``."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self._token}

    @property
    def address(self) -> str:
        """What a driver passes to ``ray.init`` (the recipe's ``ray.address``)."""
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def workers(self) -> list[RayNode]:
        return [n for n in self.nodes if n.name != "head"]

    def _ray(self) -> list[str]:
        # Ray's CLI through this interpreter: a venv with system site-packages has no `ray` script
        # beside its python, and PATH may name another Ray.
        return [sys.executable, "-m", "ray.scripts.scripts"]

    def _node_args(self, num_cpus: float, resources: dict[str, float]) -> list[str]:
        # Every port a node listens on, chosen here: the defaults (e.g. the agent's fixed 52365)
        # collide between nodes of one machine and with other clusters on it.
        node_manager, object_manager, agent_listen, agent_grpc, metrics, runtime_env = _free_ports(
            6
        )
        return [
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--node-ip-address=127.0.0.1",
            f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
            f"--dashboard-agent-listen-port={agent_listen}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            "--disable-usage-stats",
            # Nothing here reads the nodes' logs or autoscales: two Python processes a node less.
            "--include-log-monitor=false",
            "--block",
        ]

    def start_head(self) -> RayNode:
        args = [
            *self._ray(), "start", "--head", f"--port={self.gcs_port}", "--include-dashboard=false",
            "--no-monitor", f"--temp-dir={self.temp_dir}",
            *self._node_args(HEAD_NUM_CPUS, {}),
        ]  # fmt: skip
        head = RayNode("head", args)
        self.nodes.append(head)
        self._launch(head)
        self.wait_for_nodes(1)
        return head

    def add_nodes(
        self, count: int, num_cpus: float = 1, resources: dict[str, float] | None = None
    ) -> list[RayNode]:
        """``count`` worker nodes joining the head, each ``ray start --address=<head>`` with its own
        CPUs and custom resources; returned once the GCS lists them all."""
        added = []
        for _ in range(count):
            args = [
                *self._ray(),
                "start",
                f"--address={self.address}",
                *self._node_args(num_cpus, resources or {}),
            ]
            node = RayNode(f"worker{len(self.workers) + 1}", args)
            self.nodes.append(node)
            self._launch(node)
            # One at a time: raylets registering together overload the GCS of a 2-core machine.
            self.wait_for_nodes(self.num_alive())
            added.append(node)
        return added

    def _launch(self, node: RayNode) -> None:
        log = (self.root / f"{node.name}.log").open("ab")
        # Its own process group: killpg reaches the raylet, the object store and every worker.
        node.process = subprocess.Popen(
            node.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def num_alive(self) -> int:
        return sum(n.alive for n in self.nodes)

    def node_table(self) -> list[dict[str, Any]]:
        """The GCS's nodes (``NodeID``, ``Alive``, ``Resources``, ...), dead ones included; asked
        through :class:`_NodeProbe`, a process of its own, so that this one never becomes a Ray
        driver."""
        if self._probe is None or not self._probe.alive:
            self._probe = _NodeProbe(self.address, self.env, self.root / "probe.log")
        try:
            return self._probe.nodes(timeout_s=60.0)
        except ClusterError:
            self._probe.close()
            self._probe = None
            raise

    def ray_node_id(self, node: RayNode) -> str:
        """The Ray node id of ``node`` as it runs now (a restarted node gets a new one)."""
        port = next(
            int(a.split("=", 1)[1]) for a in node.args if a.startswith("--node-manager-port=")
        )
        live = [
            n["NodeID"] for n in self.node_table() if n["Alive"] and n["NodeManagerPort"] == port
        ]
        if len(live) != 1:
            raise ClusterError(
                f"{node.name} (node manager port {port}) is not a live node of {self.address}"
            )
        return live[0]

    def worker_node_ids(self, resource: str) -> list[str]:
        """Ray node ids of the live nodes that have ``resource`` (the worker nodes' custom one)."""
        return [n["NodeID"] for n in self.node_table() if n["Alive"] and resource in n["Resources"]]

    def wait_for_nodes(
        self, count: int, timeout_s: float = START_TIMEOUT_S, new_besides: set[str] | None = None
    ) -> None:
        """Wait until the GCS lists ``count`` live nodes (and, with ``new_besides``, a live one whose
        id is not in it); fail early if a ``ray start`` exits."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process is not None and node.process.poll() not in (None, -signal.SIGKILL):
                    log = (self.root / f"{node.name}.log").read_text(errors="replace")[-2000:]
                    raise ClusterError(
                        f"ray start of {node.name} exited {node.process.returncode}:\n{log}"
                    )
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                table = self.node_table()
                seen = sum(n["Alive"] for n in table)
                fresh = new_besides is None or any(n["Alive"] and n["NodeID"] not in new_besides for n in table)
                if seen == count and fresh:
                    return
            time.sleep(0.5)
        raise ClusterError(
            f"expected {count} live Ray nodes within {timeout_s:.0f} s, saw {seen}; logs in {self.root}"
        )

    def kill_node(self, node: RayNode) -> None:
        """SIGKILL the node's whole process group: raylet, object store, workers (no goodbye to
        the GCS, which notices the node is gone by its missed heartbeats)."""
        if node.process is None:
            return
        group = node.process.pid
        self._sigkill(node)
        node.process.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the raylet and workers exit after their leader
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    @staticmethod
    def _sigkill(node: RayNode) -> None:
        if node.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)

    def restart_node(self, node: RayNode) -> None:
        """The node comes back: the same ``ray start`` again (a new raylet; Ray sees a new node).
        Waits for a node id the GCS did not list before: a count of live nodes alone can match
        early, while the GCS still lists the killed raylet as alive (for up to ~8 s)."""
        known = {entry["NodeID"] for entry in self.node_table()}
        self._launch(node)
        self.wait_for_nodes(self.num_alive(), new_besides=known)

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        for node in self.nodes:  # every node's group killed first, then each one waited for
            self._sigkill(node)
        for node in reversed(self.nodes):
            self.kill_node(node)
        # `ray stop` would stop every Ray on the machine (other sessions' too): not used here.

    def __enter__(self) -> LocalRayCluster:
        self.start_head()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _NodeProbe:
    """One driver process attached to the cluster for as long as it runs, answering each line on
    its stdin with the GCS's node table: a fresh ``ray.init`` per question cost ~1.4 s of wall
    clock on 2 cores, and :meth:`LocalRayCluster.wait_for_nodes` asks every half second."""

    SCRIPT = (
        "import json, sys, ray\n"
        "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
        "keys = ('NodeID', 'Alive', 'Resources', 'NodeManagerPort')\n"
        "for _ in sys.stdin:\n"
        "    print('NODES', json.dumps([{k: n[k] for k in keys} for n in ray.nodes()]), flush=True)\n"
    )

    def __init__(self, address: str, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-c", self.SCRIPT, address], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, text=True,
            )  # fmt: skip
        # Its stdout read line by line on a thread of its own, so that a question can time out.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output: the probe exited

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def nodes(self, timeout_s: float) -> list[dict[str, Any]]:
        assert self.process.stdin is not None
        deadline = time.monotonic() + timeout_s
        try:
            self.process.stdin.write("\n")
            self.process.stdin.flush()
        except OSError:
            raise self._failed("exited") from None
        # Ray may print lines of its own on stdout too (a node it declared dead).
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if not line:
                raise self._failed("exited")
            if line.startswith("NODES "):
                return json.loads(line.removeprefix("NODES "))
        raise self._failed(f"gave no answer in {timeout_s:.0f} s")

    def _failed(self, what: str) -> ClusterError:
        return ClusterError(f"the node probe {what}: {self.log.read_text(errors='replace')[-2000:]}")

    def close(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()


# -- extraction on the cluster: the driver as a process of its own, the store's content -----------

REFERENCE_RECIPE = "recipes/reference/extract.yaml"


def cluster_extract_overrides(store: str, address: str, **extra: Any) -> list[str]:
    """``--set`` overrides for a small CPU extraction of the reference target (the bundled records,
    cut to ``batching.max_length``) on the cluster at ``address``: two CPU actors, each needing
    one ``extract_node`` resource, so that they run on the worker nodes only."""
    settings: dict[str, Any] = {
        "store": store,
        "limit": 24,
        "model.dtype": "float32",  # CPU bf16 matmuls are several times slower
        "model.device": "cpu",
        "batching.max_length": 128,  # 13 samples of the 24 records (the long chats carry no loss)
        "batching.token_budget": 512,
        "units.max_tokens": 256,  # 7 units
        "codecs.chunk_bytes": 65536,
        "planning.num_workers": 1,
        "ray.address": address,
        "ray.num_workers": 2,
        "ray.num_cpus_per_worker": 1,
        "ray.resources_per_worker": json.dumps({"extract_node": 1}),
        # One unit per actor at a time: an actor gets its next unit once the driver has committed
        # its last, so a kill after the first commit finds every actor with work still to do.
        "ray.units_in_flight_per_worker": 1,
    }
    settings.update(extra)
    return [f"{key}={value}" for key, value in settings.items()]


def start_driver(overrides: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """``hsstore extract`` of the reference recipe as its own process (a driver that can be
    SIGKILLed); its stdout (the summary, ``--json``) is piped, its log goes to ``log``."""
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "extract",
        REFERENCE_RECIPE,
        "--json",
        "--no-progress",
    ]
    for override in overrides:
        command += ["--set", override]
    with log.open("ab") as stderr:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**env, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def finish_driver(
    driver: subprocess.Popen[str], log: Path, timeout_s: float = 240.0
) -> dict[str, Any]:
    """The driver's summary (``--json``) once it exits 0; its log's tail in the error otherwise."""
    try:
        stdout, _ = driver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.communicate()
        raise ClusterError(
            f"the driver did not finish in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        ) from None
    if driver.returncode != 0:
        raise ClusterError(f"the driver exited {driver.returncode}:\n{log.read_text()[-3000:]}")
    return json.loads(stdout[stdout.index("{") :])


def wait_for_commits(
    url: str,
    options: dict[str, Any],
    count: int,
    driver: subprocess.Popen[str],
    timeout_s: float = 180.0,
) -> list[str]:
    """Poll the store's manifest until it names at least ``count`` shards; their ids."""
    from hsstore import committed_shard_ids
    from hsstore.storage import StoreLocation

    deadline = time.monotonic() + timeout_s
    committed: set[str] = set()
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise ClusterError(
                f"the driver exited ({driver.returncode}) with {len(committed)} unit(s) committed"
            )
        with contextlib.suppress(FileNotFoundError):
            committed = set(committed_shard_ids(StoreLocation(url, options)))
        if len(committed) >= count:
            return sorted(committed)
        time.sleep(0.2)
    raise ClusterError(
        f"{len(committed)} unit(s) committed after {timeout_s:.0f} s, waited for {count}"
    )


def store_content(url: str, options: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every sample of the store: ``sample_id -> (num_tokens, sha256 of its tokens, loss mask and
    every feature's decoded bytes)``, whatever shard or order it landed in. Two stores with equal
    content hold the same samples, token for token and feature byte for feature byte."""
    import hashlib

    import hsstore

    store = hsstore.open_store(url, storage_options=options)
    content: dict[str, tuple[int, str]] = {}
    for index in range(store.num_samples):
        sample = store.read_sample(index, as_numpy=True)
        digest = hashlib.sha256()
        for name in sorted(k for k in sample if k not in ("sample_id", "source_id")):
            digest.update(name.encode())
            digest.update(sample[name].tobytes())
        sample_id = sample["sample_id"]
        assert sample_id not in content, f"{sample_id} is in the store twice"
        content[sample_id] = (len(sample["input_ids"]), digest.hexdigest())
    return content


class ClusterRun:
    """One store in a fresh bucket of an S3 endpoint, and drivers extracting into it: on
    ``cluster`` (the recipe's ``ray.address``), or with ``cluster=None`` on a local Ray the driver
    starts itself (one node; ``ray.resources_per_worker`` dropped)."""

    def __init__(
        self,
        endpoint: str,
        aws_env: dict[str, str],
        cluster: LocalRayCluster | None,
        logs: Path,
        **settings: Any,
    ) -> None:
        import s3fs

        # This process reads the store through recipe-style storage options; the driver and
        # the nodes find the endpoint and keys in their AWS environment (``aws_env``).
        self.options: dict[str, Any] = {
            "key": aws_env["AWS_ACCESS_KEY_ID"],
            "secret": aws_env["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint},
        }
        bucket = f"hsstore-{secrets.token_hex(6)}"
        s3fs.S3FileSystem(**self.options).mkdir(bucket)
        self.url = f"s3://{bucket}/store"
        self.env = {**os.environ, **aws_env, **(cluster.auth_env() if cluster else {})}
        if cluster is None:
            settings = {"ray.address": "null", "ray.resources_per_worker": "{}", **settings}
        self.overrides = cluster_extract_overrides(
            self.url, cluster.address if cluster else "null", **settings
        )
        self.logs = logs
        self.num_drivers = 0
        self.log = logs / "driver0.log"

    def start(self) -> subprocess.Popen[str]:
        self.num_drivers += 1
        self.log = self.logs / f"driver{self.num_drivers}.log"
        return start_driver(self.overrides, self.env, self.log)

    def finish(self, driver: subprocess.Popen[str]) -> dict[str, Any]:
        return finish_driver(driver, self.log)

    def extract(self) -> dict[str, Any]:
        return self.finish(self.start())

    def wait_for_commits(self, count: int, driver: subprocess.Popen[str]) -> list[str]:
        return wait_for_commits(self.url, self.options, count, driver)

    @property
    def location(self) -> Any:
        from hsstore.storage import StoreLocation

        return StoreLocation(self.url, self.options)

    def content(self) -> dict[str, tuple[int, str]]:
        return store_content(self.url, self.options)

    def committed_ids(self) -> list[str]:
        """The shards the store's manifest names right now (a run in progress included)."""
        from hsstore import committed_shard_ids

        return sorted(committed_shard_ids(self.location))

    def shards(self) -> list[Any]:
        import hsstore

        return hsstore.open_store(self.url, storage_options=self.options).shards
