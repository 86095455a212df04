"""The store's format: where files are, what a sample row holds, how features are encoded, and how
a feature array's Zarr shard files are laid out, written and read (docs/format.md).

Everything that writes, reads, checks or describes a store depends on this package; it depends on
nothing in hsstore but errors and locations.

- :mod:`~hsstore.format.layout`: paths, the sample table's schema, Zarr shard file keys;
- :mod:`~hsstore.format.features`: :class:`FeatureSpec`, one per stored feature;
- :mod:`~hsstore.format.registry` and :mod:`~hsstore.format.codecs`: one registered class per codec
  (:mod:`~hsstore.format.plain_codecs`, :mod:`~hsstore.format.fp8`), encode and decode;
- :mod:`~hsstore.format.chunk_layout`: :class:`ChunkLayout`, shared by
  :mod:`~hsstore.format.array_writer` and :mod:`~hsstore.format.array_reader`.
"""

from hsstore.format import codecs  # registers the codecs (plain_codecs, fp8)
from hsstore.format.array_reader import ArrayReader
from hsstore.format.array_writer import ArrayWriter, WrittenFile
from hsstore.format.chunk_layout import ChunkLayout, layout_of
from hsstore.format.features import FeatureSpec, default_chunk_tokens
from hsstore.format.layout import (
    FEATURES_DIR,
    LOCK_NAME,
    MANIFEST_NAME,
    SAMPLE_SCHEMA,
    SAMPLES_FILE,
    SCALE_GROUPING,
    SCALE_SUFFIX,
    SHARDS_DIR,
    TABLE_FEATURES,
)
from hsstore.format.registry import FeatureCodec, codec_for, codec_names, register_codec

__all__ = [
    "FEATURES_DIR",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "SAMPLES_FILE",
    "SAMPLE_SCHEMA",
    "SCALE_GROUPING",
    "SCALE_SUFFIX",
    "SHARDS_DIR",
    "TABLE_FEATURES",
    "ArrayReader",
    "ArrayWriter",
    "ChunkLayout",
    "FeatureCodec",
    "FeatureSpec",
    "WrittenFile",
    "codec_for",
    "codec_names",
    "codecs",
    "default_chunk_tokens",
    "layout_of",
    "register_codec",
]
