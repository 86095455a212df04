"""hsstore verify checks shards in threads: the same findings, in the manifest's shard order, as one
thread finds, duplicate sample ids across shards included."""

from __future__ import annotations

from pathlib import Path

import pytest

import hsstore
from hsstore import StoreLocation
from hsstore.verify import verify_store
from tests.support.stores import make_lineage, make_sample, make_specs


def _damaged_store(tmp_path: Path) -> str:
    """Six shards: one with a flipped byte, one with a missing table, two repeating ids of earlier ones."""
    url = str(tmp_path / "store")
    specs = make_specs()
    records = []
    for n, samples in enumerate([[0, 1], [2, 3], [4, 1], [5, 6], [7, 8], [9, 7]]):
        writer = hsstore.ShardWriter(url, f"s{n}", specs)
        for i in samples:
            writer.add_sample(**make_sample(i, 6 + i))
        records.append(writer.finish())
    hsstore.commit_shards(url, records, features=specs, lineage=make_lineage())
    store = hsstore.open_store(url)
    damaged = Path(url) / next(f.path for f in store.shards[1].files if "aux_hidden_states" in f.path)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    (Path(url) / next(f.path for f in store.shards[3].files if f.path.endswith("samples.arrow"))).unlink()
    (Path(url) / "stray.bin").write_bytes(b"left by a crashed writer")
    return url


def test_threads_find_what_one_thread_finds_in_shard_order(tmp_path: Path) -> None:
    url = _damaged_store(tmp_path)
    one = [str(p) for p in verify_store(StoreLocation(url), threads=1)]
    kinds = [p.split(":")[0] for p in one]
    # s1 checksum, s2 duplicate of s0's sample 1, s3 missing table, s5 duplicate of s4's sample 7, the stray file
    assert kinds == ["checksum", "duplicate", "missing", "duplicate", "unreferenced"], one
    assert "sample_id 'sample-00001' also in shard s0" in one[1] and "'sample-00007' also in shard s4" in one[3]
    for threads in (2, 6, None):
        assert [str(p) for p in verify_store(StoreLocation(url), threads=threads)] == one
    assert verify_store(StoreLocation(url), checksums=False, threads=4)[0].kind == "duplicate"  # no hashing: no checksum finding
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        verify_store(StoreLocation(url), threads=0)


def test_the_cli_takes_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.cli import main

    url = _damaged_store(tmp_path)
    assert main(["verify", url, "--threads", "3"]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith("checksum: shards/s1.") and "4 problem(s)" in out.err
