"""Crashes and damage: a killed writer, flipped bytes, truncated and deleted files, parallel writers."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hsstore
from hsstore.storage import StoreLocation
from hsstore.verify import verify_store
from pipelines.cli import main as cli_main
from tests.support.paths import REPO_ROOT
from tests.support.stores import make_lineage, make_sample, make_specs, write_store

# A writer process: one shard per unit of 5 samples, committed after each unit, forever slow enough
# to be killed mid-way. Unit u holds samples 5u..5u+4.
WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    import hsstore
    from tests.support.stores import make_lineage, make_sample, make_specs
    url, units = sys.argv[1], [int(u) for u in sys.argv[2].split(",")]
    specs, lineage = make_specs(), make_lineage()
    for unit in units:
        if f"unit-{{unit:03d}}" in hsstore.committed_shard_ids(url):
            continue
        writer = hsstore.ShardWriter(url, f"unit-{{unit:03d}}", specs)
        for index in range(unit * 5, unit * 5 + 5):
            writer.add_sample(**make_sample(index, 40))
            time.sleep(0.01)
        hsstore.commit_shards(url, [writer.finish()], features=specs, lineage=lineage)
        print("committed", unit, flush=True)
    """
)


def run_writer(url: str, units: list[int]) -> subprocess.Popen:
    script = WRITER.format(repo=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", script, url, ",".join(map(str, units))], stdout=subprocess.PIPE, text=True)


def sample_ids(url: str) -> set[str]:
    return set(hsstore.open_store(url).samples.column("sample_id").to_pylist())


def test_sigkill_at_a_random_point_leaves_a_sound_store_and_a_rerun_completes_it(tmp_path):
    url = str(tmp_path / "store")
    hsstore.ensure_store(url, features=make_specs(), lineage=make_lineage())
    units = list(range(8))
    rng = random.Random(1234)
    for attempt in range(3):
        process = run_writer(url, units)
        time.sleep(rng.uniform(0.8, 2.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
        store = hsstore.open_store(url)
        committed = {s.shard_id for s in store.shards}
        # Exactly the committed shards, each complete; whatever else is on disk is garbage.
        assert sample_ids(url) == {f"sample-{i:05d}" for s in committed for i in range(int(s[-3:]) * 5, int(s[-3:]) * 5 + 5)}
        assert [p for p in verify_store(StoreLocation(url)) if p.fatal] == [], attempt
    process = run_writer(url, units)
    process.wait(timeout=120)
    assert process.returncode == 0
    assert sample_ids(url) == {f"sample-{i:05d}" for i in range(40)}
    assert [p for p in verify_store(StoreLocation(url)) if p.fatal] == []


def test_two_processes_write_disjoint_shards_one_coordinator_commits(tmp_path):
    url = str(tmp_path / "store")
    first, second = run_writer(url, [0, 2, 4, 6]), run_writer(url, [1, 3, 5, 7])
    assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0
    assert sample_ids(url) == {f"sample-{i:05d}" for i in range(40)}
    assert verify_store(StoreLocation(url)) == []


@pytest.fixture
def damaged(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=12, codec="fp8_e4m3", compression="zstd")
    return url, hsstore.open_store(url)


def _fatal(url: str) -> list[str]:
    return [str(p) for p in verify_store(StoreLocation(url)) if p.fatal]


def test_flipped_byte_in_any_feature_file_is_named(damaged):
    url, store = damaged
    feature_files = [f for s in store.shards for f in s.files if "/features.zarr/" in f.path]
    rng = random.Random(7)
    for entry in rng.sample(feature_files, 4):
        path = Path(url) / entry.path
        data = bytearray(path.read_bytes())
        position = rng.randrange(len(data))
        data[position] ^= 0x40
        path.write_bytes(bytes(data))
        problems = _fatal(url)
        assert any(entry.path in p and p.startswith("checksum") for p in problems), problems
        data[position] ^= 0x40
        path.write_bytes(bytes(data))
    assert _fatal(url) == []


def test_truncated_arrow_file_is_named(damaged):
    url, store = damaged
    table = Path(url) / store.shards[0].path / "samples.arrow"
    table.write_bytes(table.read_bytes()[:-100])
    problems = _fatal(url)
    assert any(p.startswith("size") and str(table.relative_to(url)) in p and "truncated" in p for p in problems), problems


def test_deleted_shard_is_named(damaged):
    url, store = damaged
    import shutil

    shutil.rmtree(Path(url) / store.shards[1].path)
    problems = _fatal(url)
    assert problems and all(p.startswith("missing") and store.shards[1].path in p for p in problems)


def test_verify_cli_exit_codes(damaged, capsys):
    url, store = damaged
    assert cli_main(["verify", url]) == 0
    assert f"{url}: OK" in capsys.readouterr().out
    (Path(url) / store.shards[0].path / "samples.arrow").write_bytes(b"not arrow")
    assert cli_main(["verify", url]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("size: ") and "samples.arrow" in out[0]


def test_garbage_from_a_crashed_writer_is_listed_and_collected(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=3)
    writer = hsstore.ShardWriter(url, "crashed", make_specs())
    writer.add_sample(**make_sample(42, 5))
    writer.finish()  # written, never committed
    problems = verify_store(StoreLocation(url))
    assert problems and all(p.kind == "unreferenced" and not p.fatal and "shards/crashed." in p.where for p in problems)
    from hsstore.gc import collect_garbage

    removed = collect_garbage(StoreLocation(url), min_age_s=0)
    assert len(removed) == 1 and removed[0].startswith("shards/crashed.")
    assert verify_store(StoreLocation(url)) == []
    assert hsstore.open_store(url).num_samples == 3


def test_reads_refuse_damaged_data_naming_the_file(tmp_path):
    """A flipped byte is caught by the reader itself, not only by verify: inner chunks carry a
    crc32c that zarr checks on read, and the sample table is hashed before use."""
    from hsstore import ShardCorruptError

    url = str(tmp_path / "store")
    write_store(url, num_samples=6, shard_max_tokens=10_000)  # uncompressed bf16: no decoder to trip
    store = hsstore.open_store(url)
    shard = store.shards[0]
    data_file = next(f for f in shard.files if "/features.zarr/aux_hidden_states/c/" in f.path)
    path = Path(url) / data_file.path
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="aux_hidden_states"):
        hsstore.open_store(url).read_token_range(shard.shard_id, 0, shard.num_tokens, ["aux_hidden_states"])
    table = Path(url) / shard.path / "samples.arrow"
    raw = bytearray(table.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    table.write_bytes(bytes(raw))
    with pytest.raises(ShardCorruptError, match="samples.arrow: size or sha256 differs"):
        hsstore.open_store(url).read_sample(0)
