"""The byte-level half of the backend contract: the operations of :class:`~hsstore.storage.StoreLocation`."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hsstore.errors import CommitConflictError
from hsstore.storage import StoreLocation

MISSING = "no-such-folder/no-such-file.bin"


class BackendTests:
    """Reads, ranges, listings, writes, publishing and conflicts of one backend."""

    @pytest.fixture
    def location(self) -> Iterator[StoreLocation]:
        """A fresh, empty location of the backend under test: override in the subclass."""
        raise NotImplementedError("subclass StoreTests and override its location fixture")

    def test_a_published_file_reads_back_whole_and_in_ranges(self, location: StoreLocation) -> None:
        data = bytes(range(256)) * 40
        location.write_bytes_atomic("a/b/file.bin", data)
        assert location.exists("a/b/file.bin") and not location.exists("a/b/other.bin")
        assert location.size("a/b/file.bin") == location.file_size("a/b/file.bin") == len(data)
        assert location.file_size("a/b/file.bin", recorded=len(data)) == len(data)
        assert location.read_bytes("a/b/file.bin") == data
        assert location.read_bytes("a/b/file.bin", size=len(data)) == data
        for start, end in ((0, 1), (5, 4096), (4000, len(data)), (len(data) - 3, len(data))):
            assert bytes(location.read_range("a/b/file.bin", start, end)) == data[start:end]
        # A range past the end comes back short: the caller (the array reader) calls that damage.
        assert bytes(location.read_range("a/b/file.bin", len(data) - 10, len(data) + 10)) == data[-10:]

    def test_a_range_lands_in_the_callers_buffers(self, location: StoreLocation) -> None:
        data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
        location.write_bytes_atomic("ranges.bin", data)
        target = np.full(100, 7, dtype=np.uint8)
        scratch = np.zeros(30, dtype=np.uint8)
        buffers = [target[10:60], scratch, target[60:61]]
        filled: list[tuple[int, bytes]] = []  # on_filled's calls, with the buffer's bytes then
        assert location.read_range_into("ranges.bin", 1234, buffers, lambda i: filled.append((i, bytes(buffers[i])))) == 81
        assert target[10:61].tobytes() == data[1234:1284] + data[1314:1315]
        assert scratch.tobytes() == data[1284:1314]
        assert (target[:10] == 7).all() and (target[61:] == 7).all()
        # Each buffer reported once, in order, already holding its bytes when reported.
        assert filled == [(0, data[1234:1284]), (1, data[1284:1314]), (2, data[1314:1315])]
        assert location.read_range_into("ranges.bin", len(data) - 20, [np.zeros(50, dtype=np.uint8)]) == 20
        # A short read reports the buffers it filled and never the one it left short.
        short = [np.zeros(15, dtype=np.uint8), np.zeros(15, dtype=np.uint8)]
        reported: list[int] = []
        assert location.read_range_into("ranges.bin", len(data) - 20, short, reported.append) == 20
        assert reported in ([], [0])  # [0]: filled; []: a backend that drops a short body whole

    def test_missing_keys_are_file_not_found_naming_the_key(self, location: StoreLocation) -> None:
        named = re.escape("no-such-file.bin")
        with pytest.raises(FileNotFoundError, match=named):
            location.read_bytes(MISSING)
        with pytest.raises(FileNotFoundError, match=named):
            location.read_range(MISSING, 0, 10)
        with pytest.raises(FileNotFoundError, match=named):
            location.size(MISSING)
        with pytest.raises(FileNotFoundError, match=named):
            location.read_bytes_versioned(MISSING)
        assert not location.exists(MISSING)
        assert location.list_files("no-such-folder") == [] and location.list_dir("no-such-folder") == []
        location.remove_tree("no-such-folder")  # nothing there is fine

    def test_listing_names_files_by_key(self, location: StoreLocation) -> None:
        keys = ["shards/s1.a/samples.arrow", "shards/s1.a/x/c/0", "shards/s2.b/samples.arrow", "top.json"]
        for key in reversed(keys):
            location.write_bytes_atomic(key, key.encode())
        assert location.list_files() == keys
        assert location.list_files("shards/s1.a") == keys[:2]
        assert location.list_dir("shards") == ["s1.a", "s2.b"]
        assert set(location.list_dir("")) >= {"shards", "top.json"}
        stamp = location.last_modified("shards/s1.a")
        assert stamp is None or abs(stamp - time.time()) < 3600

    def test_streamed_writes_hash_and_delete(self, location: StoreLocation) -> None:
        location.makedirs("streams")
        with location.open_write("streams/one.bin") as handle:
            for piece in range(5):
                handle.write(bytes([piece]) * 100_000)
        data = b"".join(bytes([piece]) * 100_000 for piece in range(5))
        assert location.read_bytes("streams/one.bin") == data
        assert location.sha256("streams/one.bin") == (len(data), hashlib.sha256(data).hexdigest())
        location.write_bytes("streams/two.bin", b"two")
        location.delete("streams/one.bin")
        assert location.list_files("streams") == ["streams/two.bin"]
        location.remove_tree("streams")
        assert location.list_files("streams") == [] and not location.exists("streams/two.bin")

    def test_an_overwrite_is_whole_and_leaves_no_temporary_file(self, location: StoreLocation) -> None:
        location.write_bytes_atomic("manifest.json", b"old" * 1000)
        location.write_bytes_atomic("manifest.json", b"new")
        assert location.read_bytes("manifest.json") == b"new"
        assert location.list_files() == ["manifest.json"]

    def test_a_staged_shard_folder_is_published_whole(self, location: StoreLocation) -> None:
        folder = "shards/unit-000.abc"
        staging = location.staging_folder(folder)
        location.makedirs(staging)
        location.write_bytes(f"{staging}/samples.arrow", b"table")
        with location.open_write(f"{staging}/features.zarr/x/c/0") as handle:
            handle.write(b"chunk")
        location.publish_folder(staging, folder)
        assert location.list_files(folder) == [f"{folder}/features.zarr/x/c/0", f"{folder}/samples.arrow"]
        assert location.read_bytes(f"{folder}/samples.arrow") == b"table"
        assert location.list_files("shards") == location.list_files(folder)

    def test_a_stale_publish_is_refused_or_committers_are_serialised(self, location: StoreLocation) -> None:
        """Either the backend versions files (a publish based on a stale read is refused) or it
        returns no version and its commit lock keeps a second committer out."""
        location.write_bytes_if("manifest.json", b"first", None)
        data, version = location.read_bytes_versioned("manifest.json")
        assert data == b"first"
        if version is None:
            self._check_the_lock_excludes(location)
            return
        location.write_bytes_if("manifest.json", b"second", version)  # another committer moves it on
        with pytest.raises(CommitConflictError, match="manifest.json"):
            location.write_bytes_if("manifest.json", b"stale", version)
        with pytest.raises(CommitConflictError, match="manifest.json"):
            location.write_bytes_if("manifest.json", b"created", None)  # create-only, but it exists
        assert location.read_bytes("manifest.json") == b"second"

    @staticmethod
    def _check_the_lock_excludes(location: StoreLocation) -> None:
        errors: list[BaseException] = []

        def second_committer() -> None:
            try:
                with location.commit_lock(timeout_s=0.2):
                    pass
            except CommitConflictError as err:
                errors.append(err)

        with location.commit_lock():
            thread = threading.Thread(target=second_committer)
            thread.start()
            thread.join()
        assert len(errors) == 1, "a second committer got the lock while the first held it"
        with location.commit_lock(timeout_s=5):  # released: free again
            pass

    def test_a_location_travels_to_another_process_by_url(self, location: StoreLocation) -> None:
        """What pickling sends (Ray workers, DataLoader processes): the class, the URL and the
        storage options, from which the other side rebuilds the location."""
        location.write_bytes_atomic("x.bin", b"payload")
        rebuild, args = location.__reduce__()[:2]
        copy = rebuild(*args)
        assert type(copy) is type(location) and copy.url == location.url
        assert copy.read_bytes("x.bin") == b"payload"

    def test_zarr_reads_what_zarr_wrote_through_the_backend(self, location: StoreLocation) -> None:
        import zarr

        values = np.arange(60, dtype=np.uint16).reshape(20, 3)
        group = zarr.open_group(location.zarr_store("g", read_only=False), mode="w")
        group.create_array("a", shape=values.shape, dtype=values.dtype, chunks=(8, 3))[:] = values
        array = zarr.open_array(location.zarr_store("g", read_only=True), path="a", mode="r", zarr_format=3)
        np.testing.assert_array_equal(array[:], values)
        assert "g/a/zarr.json" in location.list_files("g")
