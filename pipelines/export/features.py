"""``hsstore export-features``: a store's samples written in a peer's offline layout.

For side-by-side runs with SpecForge's and speculators' trainers, and for users who must hand
features to them. The store is read in blocks of whole samples (one ranged read per block and
feature, not one per sample), each sample written to a temporary name and renamed
(:mod:`pipelines.export.peer_layouts` holds the layouts), and last a ``README.md`` and an
``hsstore-export.json`` that say what neither format records: the target, the aux layer ids (in
both numberings), the conventions and which store sample each file holds.

Fidelity:
- **specforge**: bit-exact. The aux states and the post-norm final state are written as the store
  decodes them (a bf16 store's bits unchanged; an fp8 store's values as the trainer sees them).
- **speculators**: its last slot is the final state *before* the final norm (its trainer applies
  the verifier's norm). The store keeps the post-norm state ``y = w * x / rms(x)``, from which
  ``x`` cannot be recovered (its scale is gone). What is written is ``z = y / w`` (0 where the
  norm weight is 0), whose RMS is 1 up to the norm's epsilon, so the verifier's norm gives back
  ``w * z = y`` up to bf16 rounding; needs the target's norm weight (``--target``). A speculators
  file holds one dtype for all slots (bf16 here); an fp8 store is written decoded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsstore
from hsstore.aux_layers import AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE
from hsstore.errors import HsstoreError
from hsstore.format import codecs
from pipelines.export.peer_layouts import (
    SPECULATORS_HIDDEN_DIR,
    specforge_sample_path,
    speculators_sample_path,
    write_specforge_sample,
    write_speculators_sample,
)

FEATURE_FORMATS = ("specforge", "speculators")
INDEX_NAME = "hsstore-export.json"
README_NAME = "README.md"
BLOCK_TOKENS = 1 << 16  # tokens read per ranged read: MBs per feature, whole samples only


class FeatureExportError(HsstoreError, ValueError):
    """The store cannot be written in the asked-for layout, or the selection is invalid."""


@dataclass
class FeatureExportSummary:
    format: str
    out_dir: str
    num_samples: int
    num_tokens: int
    bytes_written: int
    seconds: float


@dataclass(frozen=True)
class _Selected:
    """One store sample to export, and where it lands (``file_index``)."""

    file_index: int
    shard_id: str
    row: int
    token_offset: int
    num_tokens: int
    sample_id: str


def parse_sample_selection(spec: str, store: hsstore.Store) -> list[int]:
    """Store sample indices from ``--samples``: ``"0-99,120"`` (indices and inclusive ranges), or
    ``@FILE`` with one sample id per line (as in ``store.samples['sample_id']``)."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            wanted = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        except OSError as err:
            raise FeatureExportError(f"--samples {spec}: cannot read {path}: {err}") from err
        ids = store.samples.column("sample_id").to_pylist()
        position = {sample_id: index for index, sample_id in enumerate(ids)}
        unknown = [sample_id for sample_id in wanted if sample_id not in position]
        if unknown:
            raise FeatureExportError(f"{path}: {len(unknown)} sample ids not in {store.url}, first {unknown[0]!r}")
        return [position[sample_id] for sample_id in wanted]
    indices: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                indices.extend(range(first, last + 1))
            else:
                indices.append(int(part))
        except ValueError as err:
            raise FeatureExportError(f"--samples: {part!r} is neither an index nor a range like 0-99") from err
    bad = [i for i in indices if not 0 <= i < store.num_samples]
    if bad:
        raise FeatureExportError(f"--samples: index {bad[0]} outside the store's {store.num_samples} samples")
    return indices


def _selection(store: hsstore.Store, indices: Sequence[int] | None, limit: int | None) -> list[_Selected]:
    table = store.samples
    chosen = list(range(store.num_samples)) if indices is None else list(indices)
    if limit is not None:
        chosen = chosen[:limit]
    columns = {name: table.column(name).to_pylist() for name in ("shard_id", "row", "token_offset", "num_tokens", "sample_id")}
    return [
        _Selected(file_index, columns["shard_id"][i], columns["row"][i], columns["token_offset"][i], columns["num_tokens"][i], columns["sample_id"][i])
        for file_index, i in enumerate(chosen)
    ]


def _blocks(selected: list[_Selected]) -> Iterator[list[_Selected]]:
    """Runs of samples adjacent in one shard, at most ``BLOCK_TOKENS`` tokens (or one sample)."""
    block: list[_Selected] = []
    for item in selected:
        if block and (
            item.shard_id != block[-1].shard_id
            or item.token_offset != block[-1].token_offset + block[-1].num_tokens
            or item.token_offset + item.num_tokens - block[0].token_offset > BLOCK_TOKENS
        ):
            yield block
            block = []
        block.append(item)
    if block:
        yield block


def _decode_block(store: hsstore.Store, block: list[_Selected]) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
    """The block's aux and final states decoded (bf16 bits viewed, fp8 expanded), ids and mask."""
    start = block[0].token_offset
    stop = block[-1].token_offset + block[-1].num_tokens
    names = [AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE]
    raw = store.read_token_range(block[0].shard_id, start, stop, names + ["input_ids", "loss_mask"])
    decoded = {name: codecs.decode_torch(store.features[name], raw, name) for name in names}
    return decoded, np.asarray(raw["input_ids"], dtype=np.int64), np.asarray(raw["loss_mask"], dtype=np.int64)


def _check_store(store: hsstore.Store, format: str) -> None:  # noqa: A002
    missing = [name for name in (AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE) if name not in store.features]
    if missing:
        raise FeatureExportError(
            f"{store.url}: the {format} layout needs features {AUX_HIDDEN_STATES} and "
            f"{FINAL_HIDDEN_STATE}; this store lacks {missing} (its target distribution is "
            f"{store.lineage.target_distribution!r}: extract with teacher final_hidden)"
        )


class _PreNormEquivalent:
    """Maps the stored post-norm final state ``y`` to ``z = y / w``, which the verifier's RMSNorm
    turns back into ``y`` (see the module docstring)."""

    def __init__(self, target_dir: str | os.PathLike[str], hidden_size: int):
        from pipelines.train.target_heads import load_target_heads

        heads = load_target_heads(target_dir)
        weight = heads.norm_weight_H.to(torch.float32)
        if weight.numel() != hidden_size:
            raise FeatureExportError(
                f"{target_dir}: final norm has {weight.numel()} weights, the store's hidden size is {hidden_size}"
            )
        self.inverse_weight = torch.where(weight == 0, torch.zeros_like(weight), 1.0 / weight)

    def __call__(self, final_TH: torch.Tensor) -> torch.Tensor:
        return (final_TH.to(torch.float32) * self.inverse_weight).to(final_TH.dtype)


def export_features(
    store_url: str,
    out_dir: str | os.PathLike[str],
    format: str = "specforge",  # noqa: A002 (the CLI's --format)
    *,
    samples: Sequence[int] | None = None,
    limit: int | None = None,
    target: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> FeatureExportSummary:
    """Write the store's samples (``samples`` indices in that order, else all in store order;
    the first ``limit`` of them) to ``out_dir`` in ``format``'s layout; file ``i`` holds the
    ``i``-th selected sample. ``target`` (the target's directory) is needed for ``speculators``."""
    if format not in FEATURE_FORMATS:
        raise FeatureExportError(f"unknown feature format {format!r}; choose one of {', '.join(FEATURE_FORMATS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FeatureExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(out)
    store = hsstore.open_store(store_url)
    _check_store(store, format)
    selected = _selection(store, samples, limit)
    hidden_size = int(store.features[FINAL_HIDDEN_STATE].shape[-1])
    pre_norm = None
    if format == "speculators":
        if target is None:
            raise FeatureExportError(
                "--format speculators needs --target TARGET_DIR: speculators keeps the final state "
                "before the final norm, rebuilt here from the stored post-norm state and the norm weight"
            )
        pre_norm = _PreNormEquivalent(target, hidden_size)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    written, tokens = 0, 0
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    bar = _progress_bar(len(selected), format, progress)
    for block in _blocks(selected):
        decoded, ids, mask = _decode_block(store, block)
        base = block[0].token_offset
        for item in block:
            lo, hi = item.token_offset - base, item.token_offset - base + item.num_tokens
            ids_T, mask_T = torch.from_numpy(ids[lo:hi]), torch.from_numpy(mask[lo:hi])
            aux_TKH, final_TH = decoded[AUX_HIDDEN_STATES][lo:hi], decoded[FINAL_HIDDEN_STATE][lo:hi]
            if pre_norm is None:
                written += write_specforge_sample(out / specforge_sample_path(item.file_index), ids_T, mask_T, aux_TKH, final_TH)
            else:
                hidden_TLH = torch.cat([aux_TKH, pre_norm(final_TH).unsqueeze(1)], dim=1)
                written += write_speculators_sample(out / speculators_sample_path(item.file_index), ids_T, hidden_TLH)
                rows["input_ids"].append(ids[lo:hi].tolist())
                rows["loss_mask"].append(mask[lo:hi].tolist())
                rows["seq_len"].append(item.num_tokens)
            tokens += item.num_tokens
            bar.update(1)
            bar.set_postfix(tokens=tokens, refresh=False)
    bar.close()
    if format == "speculators":
        written += _write_speculators_dataset(out, rows)
    summary = FeatureExportSummary(format, str(out), len(selected), tokens, written, time.perf_counter() - began)
    _write_description(out, store, selected, summary, target)
    return summary


def _progress_bar(total: int, format: str, enabled: bool) -> Any:  # noqa: A002
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"export-features {format}", unit="sample", disable=not enabled, dynamic_ncols=True)


def _write_speculators_dataset(out: Path, rows: dict[str, list[Any]]) -> int:
    """The ``datasets`` folder speculators' ``ArrowDataset`` loads (``load_from_disk(out)``)."""
    try:
        import datasets
    except ImportError as err:
        raise FeatureExportError(
            "--format speculators writes a Hugging Face datasets folder: pip install 'hsstore[all]' "
            "(or pip install datasets; speculators itself requires it)"
        ) from err
    dataset = datasets.Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    # save_to_disk writes its arrow files, dataset_info.json and state.json into `out`, beside
    # hidden_states/; speculators looks for both under the same path.
    dataset.save_to_disk(str(out))
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _write_description(
    out: Path, store: hsstore.Store, selected: list[_Selected], summary: FeatureExportSummary, target: Any
) -> None:
    lineage = store.lineage
    aux = list(lineage.aux_layer_ids)
    index = {
        "exported_by": "hsstore export-features",
        "summary": asdict(summary),
        "store": store.url,
        "aux_layer_ids_hf": aux,
        "aux_layer_ids_sglang": [i - 1 for i in aux],
        "layer_convention": lineage.layer_convention,
        "final_state": "post_norm" if summary.format == "specforge" else "post_norm / norm_weight (pre-norm equivalent)",
        "lineage": lineage.model_dump(mode="json"),
        "files": [
            {"file": (specforge_sample_path if summary.format == "specforge" else speculators_sample_path)(item.file_index),
             "sample_id": item.sample_id, "num_tokens": item.num_tokens}
            for item in selected
        ],
    }
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    target_line = lineage.target.model_dump(mode="json") if lineage.target is not None else "not recorded"
    layout = (
        "one `torch.save` file per sample: `rows_<g>-<g+5000>/data_<i>.ckpt` with `input_ids`, "
        "`loss_mask` ([T] int64), `hidden_state` ([1, T, H], post-norm final state) and "
        "`aux_hidden_state` ([1, T, K*H], aux layers concatenated in the order below)"
        if summary.format == "specforge"
        else f"a `datasets` folder (`input_ids`, `loss_mask`, `seq_len`) and `{SPECULATORS_HIDDEN_DIR}/hs_<i>.safetensors` "
        "(`hidden_states` [T, K+1, H], `token_ids`); the last slot is the post-norm final state divided "
        "by the target's final-norm weight, which the verifier's norm maps back to the post-norm state"
    )
    (out / README_NAME).write_text(
        f"# Features exported from an hsstore store ({summary.format} layout)\n\n"
        f"Written by `hsstore export-features` from `{store.url}`: {summary.num_samples} samples, "
        f"{summary.num_tokens} tokens. Layout: {layout}.\n\n"
        "Neither this layout nor its trainer records what the features came from; this is it:\n\n"
        f"- target: `{json.dumps(target_line)}`\n"
        f"- aux layer ids, Hugging Face `hidden_states` index (hsstore's convention): {aux}\n"
        f"- the same layers in SGLang's numbering (index - 1; SpecForge's `aux_hidden_state_layer_ids`): {[i - 1 for i in aux]}\n"
        f"- tokenizer sha256: `{lineage.tokenizer_sha256}`, chat template sha256: `{lineage.chat_template_sha256}`\n"
        f"- max length {lineage.max_length}, data fingerprint `{lineage.data_fingerprint}`\n"
        + (f"- final-norm weight read from `{target}`\n" if target is not None else "")
        + f"\nFile `i` holds the `i`-th exported sample; `{INDEX_NAME}` maps each file to its store sample id.\n"
    )
