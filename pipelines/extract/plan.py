"""From a recipe to a plan: accepted samples, rejections, feature specs, lineage and work units.

Everything here runs in the driver and is deterministic: the same recipe over the same data gives
the same samples, the same units (so the same shard ids) and the same lineage. That is what makes
a rerun a resume: committed units are recognised by id, and a store extracted with other
settings is refused (a lineage field differs) before any compute.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hsstore
from hsstore import FeatureSpec, Lineage
from hsstore.aux_layers import default_aux_layer_ids
from hsstore.errors import LineageMismatchError
from hsstore.storage import StoreLocation
from pipelines.extract.capture import (
    AUX_FEATURE,
    FINAL_FEATURE,
    TOPK_IDS_FEATURE,
    TOPK_LOGITS_FEATURE,
)
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.records import Rejection, RejectReason, iter_records
from pipelines.extract.target import resolve_target  # noqa: F401 (the driver imports it from here)
from pipelines.extract.tokenize import SampleTokenizer, TokenizedSample
from pipelines.extract.units import SampleRow, WorkUnit
from pipelines.target_identity import (
    chat_template_sha256,
    identity_model,
    tokenizer_sha256,
)

REJECTS_PATH = "rejects/extract.jsonl"
CODE_VERSION = f"hsstore {hsstore.__version__}"
# Lineage fields that describe where things were, not what they are: a resume from another
# working directory or mount point must not be refused for them.
INFORMATIONAL_LINEAGE_FIELDS = ("target.name_or_path",)


@dataclass
class SamplePlan:
    """The accepted samples in input order, and what was rejected or truncated on the way."""

    samples: list[TokenizedSample] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    num_records: int = 0
    num_truncated: int = 0

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(str(r.reason) for r in self.rejections).items()))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def fingerprint(self) -> str:
        """sha256 of the accepted sample ids in order (ids already hash content + tokenization)."""
        digest = hashlib.sha256()
        for sample in self.samples:
            digest.update(sample.sample_id.encode() + b"\n")
        return digest.hexdigest()


def plan_samples(
    records: Iterable[Any], tokenizer: SampleTokenizer, limit: int | None = None
) -> SamplePlan:
    """Tokenize records (``Record`` or ``Rejection``), rejecting duplicates by sample id."""
    plan = SamplePlan()
    first_origin: dict[str, str] = {}
    for item in itertools.islice(records, limit):
        plan.num_records += 1
        if isinstance(item, Rejection):
            plan.rejections.append(item)
            continue
        result = tokenizer(item)
        if isinstance(result, Rejection):
            plan.rejections.append(result)
            continue
        if result.sample_id in first_origin:
            plan.rejections.append(
                Rejection(
                    RejectReason.DUPLICATE,
                    f"{item.origin}: same content as {first_origin[result.sample_id]} "
                    f"(sample_id {result.sample_id}); kept the first",
                    item.origin,
                    item.source_id,
                    (item.text or json.dumps(item.content(), ensure_ascii=False))[:200],
                )
            )
            continue
        first_origin[result.sample_id] = item.origin
        plan.num_truncated += int(result.truncated)
        plan.samples.append(result)
    return plan


def read_samples(recipe: ExtractRecipe, tokenizer: SampleTokenizer) -> SamplePlan:
    """Read, validate and tokenize the recipe's data (at most ``limit`` records)."""
    records = iter_records(recipe.data, require_assistant=recipe.tokenizer.require_assistant)
    return plan_samples(records, tokenizer, recipe.limit)


def plan_units(
    samples: list[TokenizedSample],
    max_tokens: int,
    max_samples: int,
    sort_window_tokens: int | None = None,
    first_index: int = 0,
) -> list[WorkUnit]:
    """Cut the samples into units of at most ``max_tokens`` / ``max_samples``.

    With ``sort_window_tokens``, consecutive samples are taken in windows of about that many tokens
    and each window is sorted by length (longest first, ties in input order) before it is cut: a
    unit then holds samples of similar lengths, and so do its batches, whose padding is what the
    longest row costs the others. Windows keep memory bounded and the plan deterministic (a rerun
    cuts the same units). Without it, units follow the input order.
    """
    units: list[WorkUnit] = []
    for window in length_sorted_windows(samples, sort_window_tokens):
        units.extend(cut_units(window, max_tokens, max_samples, first_index + len(units)))
    return units


def length_sorted_windows(
    samples: list[TokenizedSample], window_tokens: int | None
) -> Iterator[list[TokenizedSample]]:
    """Consecutive windows of at least ``window_tokens`` tokens (the last may be shorter), each
    sorted longest first; one window in input order without ``window_tokens``."""
    if not window_tokens:
        if samples:
            yield samples
        return
    window: list[TokenizedSample] = []
    tokens = 0
    for sample in samples:
        window.append(sample)
        tokens += sample.num_tokens
        if tokens >= window_tokens:
            yield sort_window(window)
            window, tokens = [], 0
    if window:
        yield sort_window(window)


def sort_window(window: list[TokenizedSample]) -> list[TokenizedSample]:
    """Longest first; Python's sort is stable, so equal lengths keep their input order."""
    return sorted(window, key=lambda sample: -sample.num_tokens)


def cut_units(
    samples: list[TokenizedSample], max_tokens: int, max_samples: int, first_index: int
) -> list[WorkUnit]:
    """Consecutive units of at most ``max_tokens`` / ``max_samples``, numbered from ``first_index``."""
    units: list[WorkUnit] = []
    rows: list[SampleRow] = []
    tokens = 0
    for sample in samples:
        if rows and (tokens + sample.num_tokens > max_tokens or len(rows) >= max_samples):
            units.append(WorkUnit(first_index + len(units), tuple(rows)))
            rows, tokens = [], 0
        rows.append(
            SampleRow(sample.sample_id, sample.source_id, sample.input_ids, sample.loss_mask)
        )
        tokens += sample.num_tokens
    if rows:
        units.append(WorkUnit(first_index + len(units), tuple(rows)))
    return units


def build_features(recipe: ExtractRecipe, num_aux: int, hidden_size: int) -> list[FeatureSpec]:
    """The store's feature specs, named as docs/design.md fixes them, with the recipe's codecs."""
    codecs = recipe.codecs

    def spec(name: str, shape: tuple[int, ...], choice: Any) -> FeatureSpec:
        return FeatureSpec(
            name=name,
            shape=shape,
            codec=choice.codec,
            compression=choice.compression,
            compression_level=choice.compression_level,
            chunk_bytes=codecs.chunk_bytes,
            layer_arrays=choice.layer_arrays,
        )

    features: list[FeatureSpec] = []
    if num_aux:
        features.append(spec(AUX_FEATURE, (num_aux, hidden_size), codecs.aux_hidden_states))
    if recipe.capture.final_hidden_state:
        features.append(spec(FINAL_FEATURE, (hidden_size,), codecs.final_hidden_state))
    if recipe.capture.target_distribution == "topk":
        k = recipe.capture.topk_k
        features.append(spec(TOPK_LOGITS_FEATURE, (k,), codecs.topk_logits))
        features.append(
            # The ids take the logits' compression: an int32 token id's upper bytes are mostly zero
            # (docs/compact-store.md: top-20 logits + ids 120 -> ~57 bytes/token with zstd).
            FeatureSpec(
                name=TOPK_IDS_FEATURE, shape=(k,), codec="int32", chunk_bytes=codecs.chunk_bytes,
                compression=codecs.topk_logits.compression, compression_level=codecs.topk_logits.compression_level,
            )
        )
    return features


def aux_layer_ids_for(recipe: ExtractRecipe, num_hidden_layers: int) -> list[int]:
    ids = recipe.capture.aux_layer_ids
    return list(ids) if ids is not None else default_aux_layer_ids(num_hidden_layers)


def build_lineage(
    recipe: ExtractRecipe,
    target_dir: str,
    tokenizer_dir: str,
    tokenizer: SampleTokenizer,
    aux_layer_ids: list[int],
    data_fingerprint: str,
    generation: list[dict[str, Any]] | None = None,
) -> Lineage:
    """The store's lineage, recorded in full (docs/design.md 'Lineage'); ``generation``: the
    lineage of each ``hsstore generate`` dataset among the inputs."""
    return Lineage(
        target=identity_model(target_dir, name_or_path=recipe.target, dtype=recipe.model.dtype),
        tokenizer_sha256=tokenizer_sha256(tokenizer_dir),
        chat_template_sha256=chat_template_sha256(
            getattr(tokenizer.tokenizer, "chat_template", None)
        ),
        aux_layer_ids=aux_layer_ids,
        target_distribution=recipe.capture.target_distribution,
        max_length=recipe.batching.max_length,
        data_fingerprint=data_fingerprint,
        code_version=CODE_VERSION,
        generation=generation,
        extra={
            "extract": {
                "tokenization": tokenizer.settings,
                "units": recipe.units.model_dump(mode="json"),
                "topk_k": recipe.capture.topk_k
                if recipe.capture.target_distribution == "topk"
                else None,
            }
        },
    )


def reconcile_lineage(location: StoreLocation, lineage: Lineage) -> Lineage:
    """The lineage to commit with: ours for a new store; the store's when only informational fields differ.

    Raises LineageMismatchError naming the first differing field otherwise, before any compute.
    """
    from hsstore.commit import read_manifest

    manifest = read_manifest(location)
    if manifest is None:
        return lineage
    diffs = [d for d in manifest.lineage.diff(lineage) if d[0] not in INFORMATIONAL_LINEAGE_FIELDS]
    if diffs:
        field_name, stored, ours = diffs[0]
        raise LineageMismatchError(
            f"{location.url} was extracted with other settings: lineage field {field_name!r} is "
            f"{_short(stored)} in the store and {_short(ours)} for this recipe "
            f"({len(diffs)} field(s) differ). A rerun resumes only the same recipe over the same "
            "data; write to a new store."
        )
    return manifest.lineage


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def write_rejects(location: StoreLocation, rejections: list[Rejection]) -> str:
    """Write every rejection as a JSON line to ``<store>/rejects/extract.jsonl`` (atomic; rewritten
    on each run, since a run re-derives them all). Returns the file's path."""
    lines = [json.dumps(r.to_json(), ensure_ascii=False) for r in rejections]
    data = ("\n".join(lines) + "\n" if lines else "").encode("utf-8")
    location.makedirs("rejects")
    location.write_bytes_atomic(REJECTS_PATH, data)
    return location.path(REJECTS_PATH)
