"""``hsstore import``: a peer's per-sample dumps (SpecForge, speculators) streamed into a store.

The lineage neither format records comes from the command line: the target directory (its
identity, tokenizer and chat-template hashes, exactly as extraction records them, so that
``hsstore train``'s lineage check works on the imported store), the aux layer ids in the Hugging
Face ``hidden_states`` numbering, and for speculators what its final slot holds. Every file is
checked against them (:mod:`pipelines.peer_import.sources`).

Resumable: the files, in the order of the number in their names, are cut into units of
``samples_per_shard``; unit u becomes shard ``import-<u>`` and is committed on its own, and a
rerun skips the units already committed (the same source, flags and store give the same units).
Any codec the store supports can be chosen.

Speed: each file is read, checked, projected (``teacher="topk"``) and encoded by one of
``threads`` threads, ahead of the writer, which only appends the encoded bits (its own threads
compress and hash them). Every step but ``torch.load``'s unpickling releases the GIL, so the
threads fill the cores; each runs torch on one thread (one ``[T, H] x [H, V]`` matmul per file is
too small to share out, and idle OpenMP threads spinning beside busy ones cost more than they
gave: benchmarks/LOG.md, the import's profile).
``teacher="topk"`` keeps the target's top-k logits instead of the final state, computed here from
the (post-norm) final state with the target's lm_head as extraction computes them; with fp8 aux
states and zstd that is the compact preset (docs/compact-store.md): ``--preset compact``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsstore
from hsstore import FeatureSpec, Lineage
from hsstore.aux_layers import AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE, TOPK_IDS, TOPK_LOGITS
from hsstore.format import codecs
from pipelines.peer_import.sources import (
    Expectation,
    ImportSourceError,
    SourceFile,
    SpeculatorsSource,
    list_source_files,
    read_specforge,
)
from pipelines.target_identity import (
    chat_template_sha256,
    identity_model,
    read_chat_template,
    target_identity,
    tokenizer_sha256,
)

SHARD_PREFIX = "import"
CODE_VERSION = "hsstore-import-1"
TEACHERS = ("final_hidden", "topk")
# --preset compact: docs/compact-store.md's extraction preset, for imported features.
COMPACT = {"codec": "fp8_e4m3", "compression": "zstd", "teacher": "topk", "topk_k": 20}


@dataclass
class ImportSummary:
    source: str
    store: str
    format: str
    num_files: int
    num_units: int
    units_skipped: int
    num_samples: int
    num_tokens: int
    source_bytes: int
    seconds: float
    threads: int  # files prepared at once per process


def import_lineage(
    target_dir: str, aux_layer_ids: list[int], fingerprint: str, extra: dict[str, Any], teacher: str
) -> Lineage:
    """The store's lineage, the target's identity computed as extraction computes it."""
    identity = identity_model(target_dir)
    if max(aux_layer_ids) > identity.num_hidden_layers or min(aux_layer_ids) < 0:
        raise ImportSourceError(
            f"--aux-layer-ids {aux_layer_ids}: the target has {identity.num_hidden_layers} layers "
            f"(ids 0..{identity.num_hidden_layers} in the hidden_states numbering)"
        )
    return Lineage(
        target=identity,
        tokenizer_sha256=tokenizer_sha256(target_dir),
        chat_template_sha256=chat_template_sha256(read_chat_template(target_dir)),
        aux_layer_ids=list(aux_layer_ids),
        target_distribution=teacher,
        data_fingerprint=fingerprint,
        code_version=CODE_VERSION,
        extra={"import": extra},
    )


def source_fingerprint(files: list[SourceFile]) -> str:
    """Hash of the file names in import order: a rerun over another file list (another dump, or
    another ``--limit``) is refused by the lineage check instead of mixing two imports. Sizes are
    left out on purpose: a file torn by an interrupted copy and copied again is the same file."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_path}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class UnitJob:
    """Everything a process needs to write one unit (picklable: ``--workers`` sends it)."""

    source: Path
    format: str
    target: str
    final_state: str | None
    expect: Expectation
    features: tuple[FeatureSpec, ...]
    teacher: str
    topk_k: int
    device: str
    store_url: str
    threads: int  # files prepared at once (in a worker process: its share)


@dataclass
class UnitResult:
    record: hsstore.ShardRecord
    num_samples: int
    num_tokens: int
    source_bytes: int


@dataclass
class EncodedFile:
    """One file as :meth:`hsstore.ShardWriter.add_encoded_samples` takes it: its table row and its
    features encoded (the stored arrays, fp8 scales included)."""

    row: tuple[str, str, np.ndarray, np.ndarray]  # sample_id, source_id, input_ids [T], loss_mask [T]
    arrays: dict[str, np.ndarray]
    num_tokens: int
    source_bytes: int


def import_features(
    source: str | os.PathLike[str],
    store_url: str,
    *,
    format: str,  # noqa: A002 (the CLI's --from)
    target: str,
    aux_layer_ids: list[int],
    final_state: str | None = None,
    codec: str = "bf16",
    compression: str = "none",
    teacher: str = "final_hidden",
    topk_k: int = 20,
    device: str = "cpu",
    samples_per_shard: int = 1024,
    threads: int | None = None,
    workers: int = 1,
    limit: int | None = None,
    progress: bool = True,
) -> ImportSummary:
    """Import the dump at ``source`` into ``store_url`` (created, or resumed); see the module doc.
    ``threads`` files are prepared at once (default: the cores, shared among the workers);
    ``workers`` > 1 writes that many units at once, each in its own process with its share of the
    threads; the units are committed as they finish."""
    start = time.perf_counter()
    source = Path(source)
    files = list_source_files(source, format)[:limit]
    identity = target_identity(target, hash_weights=False)
    expect = Expectation(len(aux_layer_ids), identity["hidden_size"], identity["vocab_size"])
    if format == "specforge" and final_state not in (None, "post_norm"):
        raise ImportSourceError("SpecForge's hidden_state is the final state after the norm: --final-state post_norm")
    if teacher not in TEACHERS:
        raise ImportSourceError(f"unknown teacher {teacher!r}; choose one of {', '.join(TEACHERS)}")
    job = UnitJob(
        source, format, target, final_state, expect,
        tuple(feature_specs(expect, codec, compression, teacher, topk_k)), teacher, topk_k, device,
        store_url, threads or max(1, (os.cpu_count() or 1) // max(workers, 1)),
    )
    _reader(job)(files[0], expect)  # refuse a wrong lineage before the store exists
    extra = {"from": format, "source": str(source.resolve()), "final_state": final_state or "post_norm"}
    if teacher == "topk":
        extra["topk_k"] = topk_k
    lineage = import_lineage(target, aux_layer_ids, source_fingerprint(files), extra, teacher)
    hsstore.ensure_store(store_url, features=job.features, lineage=lineage)
    done = hsstore.committed_shard_ids(store_url)
    units = [files[i : i + samples_per_shard] for i in range(0, len(files), samples_per_shard)]
    summary = ImportSummary(str(source), store_url, format, len(files), len(units), 0, 0, 0, 0, 0.0, job.threads)
    todo = [(f"{SHARD_PREFIX}-{n:06d}", unit) for n, unit in enumerate(units)]
    summary.units_skipped = sum(shard_id in done for shard_id, _ in todo)
    todo = [(shard_id, unit) for shard_id, unit in todo if shard_id not in done]
    bar = _progress(len(files), progress)
    bar.update(len(files) - sum(len(unit) for _, unit in todo))

    def committed(result: UnitResult) -> None:
        hsstore.commit_shards(store_url, [result.record], features=job.features, lineage=lineage)
        summary.num_samples += result.num_samples
        summary.num_tokens += result.num_tokens
        summary.source_bytes += result.source_bytes
        bar.update(result.num_samples)

    if workers <= 1:
        with _encoding_pool(job.threads) as pool:  # one pool for every unit: no drain between units
            for shard_id, unit in todo:
                committed(write_unit(job, shard_id, unit, pool))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        context = multiprocessing.get_context("spawn")  # torch and threads: no fork
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [pool.submit(write_unit, job, shard_id, unit) for shard_id, unit in todo]
            for future in as_completed(futures):
                committed(future.result())
    bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


_READERS: dict[tuple[Any, ...], Any] = {}
_TEACHERS: dict[tuple[Any, ...], TopKTeacher] = {}


def _reader(job: UnitJob) -> Any:
    """The job's sample reader, built once per process (speculators' opens its dataset)."""
    key = (job.source, job.format, job.target, job.final_state)
    if key not in _READERS:
        if job.format == "speculators":
            _READERS[key] = SpeculatorsSource(job.source, job.final_state or "", job.target).read
        else:
            _READERS[key] = lambda file, expect: read_specforge(job.source, file, expect)
    return _READERS[key]


def write_unit(
    job: UnitJob, shard_id: str, unit: list[SourceFile], pool: ThreadPoolExecutor | None = None
) -> UnitResult:
    """Write ``unit`` as shard ``shard_id`` (finished, not committed: the caller commits). Its
    files are prepared by ``pool`` (one of :func:`_encoding_pool`'s; without one, a pool for this
    unit), in order, up to ``2 * job.threads`` ahead of the writer."""
    if pool is None:
        with _encoding_pool(job.threads) as own_pool:
            return write_unit(job, shard_id, unit, own_pool)
    encode = _file_encoder(job)  # built here, before the threads share it
    writer = hsstore.ShardWriter(job.store_url, shard_id, list(job.features))
    num_tokens = source_bytes = 0
    try:
        with contextlib.closing(_in_order(pool, encode, unit, ahead=2 * job.threads)) as encoded_files:
            for encoded in encoded_files:
                writer.add_encoded_samples([encoded.row], encoded.arrays)
                num_tokens += encoded.num_tokens
                source_bytes += encoded.source_bytes
        record = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return UnitResult(record, len(unit), num_tokens, source_bytes)


def _file_encoder(job: UnitJob) -> Callable[[SourceFile], EncodedFile]:
    """The job's per-file work: read and check the file (the reader refuses what disagrees with
    the lineage), project the final state to the target's top-k where asked, encode every feature."""
    reader = _reader(job)
    teacher_of = None
    if job.teacher == "topk":
        key = (job.target, job.topk_k, job.device)
        if key not in _TEACHERS:
            _TEACHERS[key] = TopKTeacher(job.target, job.topk_k, job.device)
        teacher_of = _TEACHERS[key]

    def encode(file: SourceFile) -> EncodedFile:
        sample = reader(file, job.expect)
        values = {AUX_HIDDEN_STATES: sample["aux_hidden_states"]}
        if teacher_of is None:
            values[FINAL_HIDDEN_STATE] = sample["final_hidden_state"]
        else:
            values[TOPK_LOGITS], values[TOPK_IDS] = teacher_of(sample["final_hidden_state"])
        arrays: dict[str, np.ndarray] = {}
        for spec in job.features:
            arrays.update(codecs.encode(spec, values[spec.name]))
        ids, mask = sample["input_ids"].numpy(), sample["loss_mask"].numpy()
        row = (f"{job.format}:{file.relative_path}", file.relative_path, ids, mask)
        return EncodedFile(row, arrays, len(ids), (job.source / file.relative_path).stat().st_size)

    return encode


@contextlib.contextmanager
def _encoding_pool(threads: int) -> Iterator[ThreadPoolExecutor]:
    """``threads`` threads for :func:`_file_encoder`'s work, torch on one thread each meanwhile
    (torch's thread count is the process's: restored on the way out)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="hsstore-import") as pool:
            yield pool
    finally:
        torch.set_num_threads(before)


def feature_specs(
    expect: Expectation, codec: str, compression: str, teacher: str, topk_k: int
) -> list[FeatureSpec]:
    """The store's features: the aux states in ``codec``, and the final state (same codec) or the
    top-k logits (bf16) and ids (int32), everything with ``compression``."""
    aux = FeatureSpec(
        name=AUX_HIDDEN_STATES, shape=(expect.num_aux_layers, expect.hidden_size), codec=codec,
        compression=compression,
    )
    if teacher == "final_hidden":
        return [aux, FeatureSpec(name=FINAL_HIDDEN_STATE, shape=(expect.hidden_size,), codec=codec, compression=compression)]
    return [
        aux,
        FeatureSpec(name=TOPK_LOGITS, shape=(topk_k,), codec="bf16", compression=compression),
        FeatureSpec(name=TOPK_IDS, shape=(topk_k,), codec="int32", compression=compression),
    ]


class TopKTeacher:
    """The target's top-k logits of a post-norm final state: ``lm_head(final)`` in float32 (with
    the target's final-logit softcapping, as extraction applies it), k largest with their ids."""

    def __init__(self, target_dir: str, k: int, device: str) -> None:
        from pipelines.target_identity import read_config, text_config
        from pipelines.train.target_heads import load_target_heads

        heads = load_target_heads(target_dir)
        self.device = torch.device(device)
        self.lm_head_VH = heads.lm_head_VH.to(self.device, torch.float32)
        self.softcap = text_config(read_config(target_dir)).get("final_logit_softcapping")
        self.k = k

    @torch.no_grad()
    def __call__(self, final_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = [], []
        for chunk in final_TH.split(4096):
            logits = chunk.to(self.device, torch.float32) @ self.lm_head_VH.T
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            top = logits.topk(self.k, dim=-1)
            values.append(top.values.cpu())
            ids.append(top.indices.to(torch.int32).cpu())
        return torch.cat(values), torch.cat(ids)


def _in_order(
    pool: ThreadPoolExecutor, work: Callable[[SourceFile], EncodedFile], unit: list[SourceFile], ahead: int
) -> Iterator[EncodedFile]:
    """``work(file)`` for the unit's files, in order, up to ``ahead`` of them submitted at once.
    On an error (or when the caller stops early) the files not started are cancelled."""
    pending: list[Future[EncodedFile]] = []
    try:
        for file in unit:
            pending.append(pool.submit(work, file))
            if len(pending) > ahead:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for future in pending:
            future.cancel()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="import", disable=not enabled)
