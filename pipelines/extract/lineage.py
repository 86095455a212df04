"""What the store records about an extraction: its feature specs and its lineage.

Both are functions of the recipe, the target and the data, so the same recipe over the same data
gives the same lineage; that is what makes a rerun a resume. A store extracted with other settings
is refused (the first differing lineage field named) before any compute.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import hsstore
from hsstore import FeatureSpec, Lineage, ensure_store
from hsstore.aux_layers import AUX_HIDDEN_STATES as AUX_FEATURE
from hsstore.aux_layers import FINAL_HIDDEN_STATE as FINAL_FEATURE
from hsstore.aux_layers import TOPK_IDS as TOPK_IDS_FEATURE
from hsstore.aux_layers import TOPK_LOGITS as TOPK_LOGITS_FEATURE
from hsstore.aux_layers import default_aux_layer_ids
from hsstore.errors import LineageMismatchError
from hsstore.storage import StoreLocation
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.tokenize import SampleTokenizer
from pipelines.target_identity import chat_template_sha256, identity_model, tokenizer_sha256

CODE_VERSION = f"hsstore {hsstore.__version__}"
# Lineage fields that describe where things were, not what they are: a resume from another
# working directory or mount point must not be refused for them.
INFORMATIONAL_LINEAGE_FIELDS = ("target.name_or_path",)


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
    weights_sha256: dict[str, str] | None = None,
) -> Lineage:
    """The store's lineage, recorded in full (docs/design.md 'Lineage'); ``generation``: the
    lineage of each ``hsstore generate`` dataset among the inputs; ``weights_sha256``: the
    target's weight hashes when already computed (hashed here otherwise)."""
    return Lineage(
        target=identity_model(
            target_dir, name_or_path=recipe.target, dtype=recipe.model.dtype, weights_sha256=weights_sha256
        ),
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


# (the target's weight hashes, the data fingerprint) -> the lineage; and what computes the two.
LineageBuilder = Callable[[dict[str, str], str], Lineage]
SlowFingerprints = Callable[[], tuple[dict[str, str], str]]


class PendingLineage:
    """The lineage to commit with, whose slow parts are computed on a daemon thread while the
    workers start and the first units run: the target's weight hashes and the data fingerprint
    read every byte of both (16 GB for an 8B target: ~40 s cold, minutes for a 70B).

    An existing store is checked at once on every other field (the store's own weight hashes and
    data fingerprint stand in for ours), so a store extracted with other settings is refused
    before any compute; the driver then waits for :meth:`get` before it plans (a resume is refused
    before any compute for other weights or data too). A new store has nothing to differ from:
    :meth:`get` is first called for the first commit, and creates the store with the complete
    lineage then. A mismatch found there (another partition rank created the store from another
    target meanwhile) is refused before anything is committed; the units computed so far are
    uncommitted attempts, which the store never reads.
    """

    def __init__(
        self,
        location: StoreLocation,
        features: list[FeatureSpec],
        build: LineageBuilder,
        fingerprints: SlowFingerprints,
    ):
        from hsstore.commit import read_manifest

        self.location = location
        self.features = features
        self.build = build
        self.hash_seconds = 0.0  # the background thread's time hashing
        self.wait_seconds = 0.0  # the time get() waited for it
        self._lineage: Lineage | None = None
        self._done = threading.Event()
        self._result: tuple[dict[str, str], str] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._compute, args=(fingerprints,), name="lineage-fingerprints", daemon=True
        )
        self._thread.start()
        manifest = read_manifest(location)
        self.store_exists = manifest is not None
        if manifest is not None:
            stored = manifest.lineage
            reconcile_lineage(location, build(stored.target.weights_sha256, stored.data_fingerprint))

    def _compute(self, fingerprints: SlowFingerprints) -> None:
        start = time.perf_counter()
        try:
            self._result = fingerprints()
        except BaseException as err:  # noqa: BLE001 - raised by get(), in the driver's thread
            self._error = err
        finally:
            self.hash_seconds = time.perf_counter() - start
            self._done.set()

    def settle_after_failure(self) -> None:
        """A run failing before its first commit: create the store with its lineage as a run that
        gets further would (a failed run leaves a store that verifies, with its rejects and dead
        attempts), if the hashes are done; never wait for them (the failure is reported at once)
        and never raise over the failure (a mismatch here is refused by the next run)."""
        if self._lineage is None and self._done.is_set() and self._error is None:
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                self.get()

    def get(self) -> Lineage:
        """The complete lineage, reconciled with the store (created now if new); waits for the
        fingerprints the first time."""
        if self._lineage is None:
            start = time.perf_counter()
            self._done.wait()
            self.wait_seconds = time.perf_counter() - start
            if self._error is not None:
                raise self._error
            assert self._result is not None
            lineage = reconcile_lineage(self.location, self.build(*self._result))
            ensure_store(self.location, features=self.features, lineage=lineage)
            self._lineage = lineage
        return self._lineage
