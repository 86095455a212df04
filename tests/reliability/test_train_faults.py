"""Training-side faults at the loader the trainer streams from (hsstore.loader.StreamingLoader,
which ``TrainRecipe.skip_corrupt`` is passed to): a shard that no longer matches its checksum.

Decode failures (a truncated zstd chunk) are the loader's own test (tests/hsstore/test_loader.py);
a killed-and-resumed run reproducing the uninterrupted losses is the trainer's
(tests/pipelines/train/test_trainer.py). What is left is the silent case: a flipped byte in an
uncompressed bf16 shard decodes fine and is trained on unless something compares checksums.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hsstore
from hsstore import ShardCorruptError
from hsstore.loader import StreamingLoader
from tests.support.stores import write_store

pytestmark = pytest.mark.reliability


def flip_a_byte_in_a_middle_shard(url: str) -> hsstore.ShardRecord:
    store = hsstore.open_store(url)
    shard = store.shards[len(store.shards) // 2]
    victim = next(f for f in shard.files if "/features.zarr/aux_hidden_states/c/" in f.path)
    path = Path(url) / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # still a valid bf16 value: nothing fails to decode
    path.write_bytes(bytes(data))
    return shard


def epoch(url: str, **kwargs) -> tuple[int, StreamingLoader]:  # type: ignore[no-untyped-def]
    loader = StreamingLoader(url, ["aux_hidden_states", "final_hidden_state"], token_budget=128, shuffle_window=8, **kwargs)
    rows = sum(1 for _ in loader.batches(max_epochs=1))
    return rows, loader


def test_a_decodable_flipped_byte_is_what_verify_catches(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=24, shard_max_tokens=150)
    shard = flip_a_byte_in_a_middle_shard(url)
    problems = [str(p) for p in hsstore.verify_store(hsstore.StoreLocation(url)) if p.fatal]
    assert len(problems) == 1 and problems[0].startswith("checksum: ") and shard.path in problems[0]


def test_a_shard_failing_its_checksum_mid_epoch_stops_naming_it_or_is_skipped_and_counted(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=24, shard_max_tokens=150)
    shard = flip_a_byte_in_a_middle_shard(url)
    with pytest.raises(ShardCorruptError, match=rf"shard {shard.shard_id}"):
        epoch(url)
    _, loader = epoch(url, skip_corrupt=True)
    # Every inner chunk carries a crc32c, so exactly the samples whose tokens sit in the damaged
    # chunk are skipped (and counted); the shard's intact samples still train.
    assert 0 < loader.num_skipped_samples <= shard.num_samples
