"""SpecForge's offline feature layout, as ``benchmarks/specforge/peer.py`` hands it to SpecForge.

Files (``rows_<g>-<g+5000>/data_<i>.ckpt``), their lengths, the vocabulary mapping file, views that
make SpecForge's shuffling sampler visit a given order, loss-mask-aligned copies, and a stand-in
writer from an hsstore store (until ``hsstore export-features --format specforge``). No SpecForge
code is changed here; its sampler and file lister are called to lay the views out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_FEATURE_NAME = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")


class SpecForgeRunError(RuntimeError):
    """SpecForge's trainer or exporter failed, or its inputs are not what it needs."""


def feature_files(features_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{i: path}`` for every ``data_<i>.ckpt`` under ``features_dir`` (SpecForge's layout)."""
    found: dict[int, Path] = {}
    for path in sorted(Path(features_dir).rglob("data_*.ckpt*")):
        match = _FEATURE_NAME.match(path.name)
        if match is None:
            continue
        sample = int(match.group(1))
        if sample in found:
            raise SpecForgeRunError(f"{features_dir}: sample {sample} twice ({found[sample]}, {path})")
        found[sample] = path
    if not found:
        raise SpecForgeRunError(f"{features_dir}: no rows_*/data_<i>.ckpt files (SpecForge's offline layout)")
    return found


def sample_lengths(files: dict[int, Path]) -> dict[int, int]:
    """Tokens per sample, from ``input_ids`` alone (``torch.load`` with ``mmap``: no feature bytes read)."""
    import torch

    return {i: int(torch.load(p, mmap=True, weights_only=True)["input_ids"].numel()) for i, p in files.items()}


def write_vocab_mapping(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write SpecForge's ``{"d2t", "t2d"}`` mapping file from hsstore's draft vocabulary.

    ``source``: an exported draft directory or its ``model.safetensors`` (``d2t`` [draft] int64
    offsets, ``t2d`` [target] bool: the convention SpecForge uses too), or an existing ``.pt``.
    """
    import torch
    from safetensors.torch import load_file

    source = Path(source)
    weights = source / "model.safetensors" if source.is_dir() else source
    tensors = torch.load(weights, weights_only=True) if weights.suffix == ".pt" else load_file(weights)
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise SpecForgeRunError(f"{weights}: no {missing}; export the hsstore draft with `hsstore export`")
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    target_ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        raise SpecForgeRunError(f"{weights}: t2d marks {int(t2d.sum())} ids, not the {d2t.numel()} of d2t")
    # SpecForge's teacher is softmax(logits[..., t2d]): target-id order must be draft-id order.
    if not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise SpecForgeRunError(f"{weights}: draft ids are not sorted by target id, as SpecForge's teacher assumes")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path


def specforge_epoch_order(num_files: int, seed: int, epoch: int) -> list[int]:
    """Positions in the sorted file list, in the order SpecForge's offline sampler visits them."""
    from specforge.launch import _distributed_sampler_indices

    return list(_distributed_sampler_indices(num_files, dp_rank=0, dp_size=1, seed=seed, epoch=epoch))


def ordered_view(files: dict[int, Path], sample_order: Sequence[int], seed: int, view_dir: Path) -> Path:
    """Symlinks under ``view_dir`` that SpecForge's epoch 0 (with ``seed``) visits in ``sample_order``."""
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    unknown = sorted(set(sample_order) - set(files))
    if unknown:
        raise SpecForgeRunError(f"sample_order names samples with no data_<i>.ckpt file: {unknown[:10]}")
    names = [view_dir / f"rows_{p // 5000 * 5000}-{p // 5000 * 5000 + 5000}" / f"data_{p}.ckpt"
             for p in range(len(sample_order))]
    names.sort(key=lambda p: str(p.absolute()))  # SpecForge sorts absolute paths as strings
    for position, sample in zip(specforge_epoch_order(len(names), seed, 0), sample_order, strict=True):
        link = names[position]
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(files[sample].resolve())
    if list_feature_files(str(view_dir)) != [str(p.absolute()) for p in names]:
        raise SpecForgeRunError(f"{view_dir}: SpecForge lists the view's files in another order")
    return view_dir


def aligned_loss_mask_copy(files: dict[int, Path], samples: Sequence[int], out_dir: Path) -> dict[int, Path]:
    """Copies of ``samples`` whose ``loss_mask`` is shifted left by two (0 for the last two tokens).

    SpecForge scores the prediction of token ``j + 2`` with ``loss_mask[j]`` (docs/vs-specforge.md,
    item 1); with ``loss_mask'[j] = loss_mask[j + 2]`` it scores exactly the positions hsstore
    scores. A data shim, for comparing the trainers rather than that convention.
    """
    import torch

    copies: dict[int, Path] = {}
    for sample in sorted(set(samples)):
        data = torch.load(files[sample], weights_only=True)
        mask = torch.zeros_like(data["loss_mask"])
        mask[:-2] = data["loss_mask"][2:]
        data["loss_mask"] = mask
        path = out_dir / f"rows_{sample // 5000 * 5000}-{sample // 5000 * 5000 + 5000}" / f"data_{sample}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
        copies[sample] = path
    return copies


def hsstore_sample_order(store: Any, *, seed: int, token_budget: int, rows_per_batch: int,
                         shuffle_window: int, epochs: int, remainder: str = "drop") -> list[int]:
    """The samples ``hsstore train`` visits (rows flattened, epoch after epoch), for ``sample_order``."""
    from hsstore.loader import StreamingLoader

    loader = StreamingLoader(store, [], token_budget=token_budget, rows_per_batch=rows_per_batch, seed=seed,
                             shuffle_window=shuffle_window, remainder=remainder, long_samples="truncate")
    return [int(s) for e in range(epochs) for batch in loader.plan(e).batches for row in batch for s in row]


def write_features_from_store(store: Any, out_dir: str | os.PathLike[str], limit: int | None = None) -> Path:
    """SpecForge's offline files from an hsstore store, sample ``i`` as ``data_<i>.ckpt``.

    A stand-in for ``hsstore export-features --format specforge`` in tests: the aux states
    ``[T, A, H]`` become ``[1, T, A*H]`` (layers concatenated in the store's order), the post-norm
    final state ``[1, T, H]``, the loss mask int64; the bits are the store's.
    """
    import torch

    import hsstore

    store = hsstore.open_store(store) if isinstance(store, (str, os.PathLike)) else store
    out = Path(out_dir)
    for i in range(store.num_samples if limit is None else min(limit, store.num_samples)):
        sample = store.read_sample(i)
        aux = sample["aux_hidden_states"]
        rows = out / f"rows_{i // 5000 * 5000}-{i // 5000 * 5000 + 5000}"
        rows.mkdir(parents=True, exist_ok=True)
        torch.save({
            "input_ids": sample["input_ids"].to(torch.int64),
            "loss_mask": sample["loss_mask"].to(torch.int64),
            "hidden_state": sample["final_hidden_state"].unsqueeze(0).contiguous(),
            "aux_hidden_state": aux.reshape(1, aux.shape[0], -1).contiguous(),
        }, rows / f"data_{i}.ckpt")
    return out
