"""A disk that fills up during extraction: a clear error, a valid store, and a rerun that completes.

A real filesystem is filled: a small tmpfs mounted for the test (the suite runs as root here and in
CI). Where mounting is not permitted the tests skip and say so; no substitute pretends to be ENOSPC.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import hsstore
from hsstore import StoreLocation, StoreWriteError
from hsstore.verify import verify_store
from tests.reliability.conftest import expected_sample_ids, load_extract_recipe, write_text_records
from tests.support.stores import make_lineage, make_sample, make_specs

pytestmark = pytest.mark.reliability


class SmallDisk:
    """A tmpfs of a given size, that can be grown in place (``mount -o remount,size=``)."""

    def __init__(self, path: Path, size_kib: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs to fill ({result.stderr.strip() or result.returncode}); needs root")

    def resize(self, size_kib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "small-disk", 1200)
    yield disk
    disk.unmount()


def fatal(url: str) -> list[str]:
    return [str(p) for p in verify_store(StoreLocation(url)) if p.fatal]


@pytest.mark.slow
def test_extraction_on_a_full_disk_fails_clearly_and_a_rerun_completes(small_disk, tmp_path):
    from pipelines.extract import run_extraction

    url = str(small_disk.path / "store")
    data = write_text_records(tmp_path / "records.jsonl", 40)
    # bf16 features of the reference target: 3 KiB/token; 1200 KiB holds about two units of ~160 tokens.
    recipe = load_extract_recipe(url, data, executor="local")
    with pytest.raises(OSError, match="No space left on device") as raised:
        run_extraction(recipe)
    assert raised.value.errno == errno.ENOSPC
    store = hsstore.open_store(url)
    committed_before = {s.shard_id for s in store.shards}
    assert committed_before, "the disk should fill after some units were committed"
    assert fatal(url) == []
    expected = expected_sample_ids(recipe)
    assert set(store.samples.column("sample_id").to_pylist()) < expected
    # Space is back: the same recipe resumes, skips what was committed and completes the store.
    small_disk.resize(16 * 1024)
    summary = run_extraction(recipe)
    assert summary.num_units_skipped == len(committed_before)
    store = hsstore.open_store(url)
    ids = store.samples.column("sample_id").to_pylist()
    assert len(ids) == len(expected) and set(ids) == expected
    assert fatal(url) == []


def test_a_manifest_commit_on_a_full_disk_leaves_the_previous_manifest(small_disk):
    url = str(small_disk.path / "store")
    specs, lineage = make_specs(), make_lineage()
    hsstore.ensure_store(url, features=specs, lineage=lineage)
    records = []
    for unit in range(3):
        writer = hsstore.ShardWriter(url, f"unit-{unit}", specs)
        writer.add_sample(**make_sample(unit, 5))
        records.append(writer.finish())
    hsstore.commit_shards(url, records[:1], features=specs, lineage=lineage)
    before = (small_disk.path / "store" / "manifest.json").read_bytes()
    # Fill the disk completely, then try to commit the other two shards.
    filler = small_disk.path / "filler"
    with filler.open("wb") as handle, pytest.raises(OSError):
        while True:
            handle.write(b"\0" * 65536)
            handle.flush()
    with pytest.raises(StoreWriteError, match=r"manifest\.json: could not write .* the previous version is untouched"):
        hsstore.commit_shards(url, records[1:], features=specs, lineage=lineage)
    assert (small_disk.path / "store" / "manifest.json").read_bytes() == before
    assert not list((small_disk.path / "store").glob(".manifest.json.*.tmp"))
    assert {s.shard_id for s in hsstore.open_store(url).shards} == {"unit-0"}
    filler.unlink()
    hsstore.commit_shards(url, records[1:], features=specs, lineage=lineage)
    assert {s.shard_id for s in hsstore.open_store(url).shards} == {"unit-0", "unit-1", "unit-2"}
    assert fatal(url) == []


def test_a_shard_write_on_a_full_disk_names_the_shard_and_the_store(small_disk):
    url = str(small_disk.path / "store")
    writer = hsstore.ShardWriter(url, "unit-big", make_specs(hidden=256))
    with pytest.raises(StoreWriteError, match=r"shard unit-big: .*small-disk/store.*No space left on device"):
        for index in range(400):
            writer.add_sample(**make_sample(index, 50, hidden=256))
        writer.finish()
