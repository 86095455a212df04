"""What a target model *is*, as hashes: the identity that extraction records and training checks.

The store's lineage pins the target so that a trainer can refuse a store extracted from another
model (another revision, another config, another tokenizer or chat template): each of those
shows up otherwise only as a lower acceptance length. Extraction calls these functions on the
target directory and stores the result; the trainer calls the *same* functions on the directory
it was given and compares field by field. Keep them pure: they read files, never load a model,
never touch the network, and return plain JSON-able values.

Conventions (also in docs/extraction.md):

- ``config_sha256``: sha256 of config.json as canonical JSON (sorted keys, no whitespace), minus
  keys that describe the software that wrote the file rather than the model
  (``transformers_version``, ``_name_or_path``), so re-saving with another transformers version
  keeps the identity.
- ``weight_files``: ``{file name: sha256}`` of every ``*.safetensors`` file (``*.bin`` when there is
  no safetensors). A Hugging Face cache blob's name *is* its sha256, so a file that is a symlink to
  ``.../blobs/<64 hex>`` is not re-read (hashing 16 GB of Qwen3-8B takes ~40 s otherwise).
- ``tokenizer_sha256``: the tokenizer files that exist (tokenizer.json, tokenizer_config.json minus
  its ``chat_template`` key, special_tokens_map.json, tokenizer.model, vocab.json, merges.txt), each
  hashed, then the (name, hash) list hashed. The chat template is left out on purpose so that the
  two hashes answer separate questions.
- ``chat_template_sha256``: sha256 of the template text the tokenizer would use
  (chat_template.jinja, else tokenizer_config.json's ``chat_template``, else chat_template.json);
  ``None`` when the target has none.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hsstore.lineage import TargetIdentity

# Keys of config.json that record the writing software, not the model.
_CONFIG_KEYS_IGNORED = ("transformers_version", "_name_or_path", "_commit_hash")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_HASH_BLOCK_BYTES = 8 << 20


def canonical_json(value: Any) -> bytes:
    """The one JSON encoding used for hashing: sorted keys, no whitespace, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, reusing the Hugging Face cache's blob name when it is one."""
    path = Path(path)
    if path.is_symlink():
        blob = Path(os.path.realpath(path))
        if blob.parent.name == "blobs" and len(blob.name) == 64:
            try:
                int(blob.name, 16)
                return blob.name
            except ValueError:
                pass
    stat = path.stat()
    key = f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    cache = _HashCache() if stat.st_size >= HASH_CACHE_MIN_BYTES else None
    if cache is not None and (known := cache.get(key)) is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    if cache is not None:
        cache.put(key, digest.hexdigest())
    return digest.hexdigest()


# Weight files of a local target are hashed on every extraction (the lineage pins them): 16 GB for
# an 8B model is ~10 s, 140 GB for a 70B over a minute. The digest of a large file is remembered
# under its path, size, mtime and inode, as git's index trusts a file's stat; any change rehashes.
HASH_CACHE_MIN_BYTES = 64 << 20


# Threads of this process hashing files at once (weight_file_hashes) update the cache one at a time.
_CACHE_LOCK = threading.Lock()


class _HashCache:
    """``$HSSTORE_CACHE_DIR/file-sha256.json`` (default ``~/.cache/hsstore``); best effort: a cache
    that cannot be read or written is no cache."""

    def __init__(self) -> None:
        root = os.environ.get("HSSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hsstore")
        self.path = Path(root) / "file-sha256.json"

    def _load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> str | None:
        value = self._load().get(key)
        return value if isinstance(value, str) and len(value) == 64 else None

    def put(self, key: str, digest: str) -> None:
        with _CACHE_LOCK:
            self._put(key, digest)

    def _put(self, key: str, digest: str) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = self._load()
            entries[key] = digest
            temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            temp.write_text(json.dumps(entries), encoding="utf-8")
            os.replace(temp, self.path)
        except OSError:
            pass


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a model directory, with an error naming the file."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{path} does not exist: the target must be a Hugging Face model directory"
        ) from err


def config_sha256(config: dict[str, Any]) -> str:
    """Hash of a config dict as canonical JSON, ignoring the software-version keys."""
    kept = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_IGNORED}
    return sha256_bytes(canonical_json(kept))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under ``text_config``)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "num_hidden_layers" in nested else config


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files the identity hashes: every ``*.safetensors``, else every ``*.bin``."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors (or *.bin) weight files")
    return files


# Files hashed at once: sha256 runs at ~1-2 GB/s on one core and hashlib releases the GIL, so a
# sharded checkpoint on a fast disk (or in the page cache) hashes several times faster in parallel.
HASH_THREADS = 4


def weight_file_hashes(model_dir: str | Path, threads: int = HASH_THREADS) -> dict[str, str]:
    """``{file name: sha256}`` of the weight files, safetensors preferred over pickled .bin."""
    files = weight_files(model_dir)
    return dict(zip((f.name for f in files), _map_on_daemon_threads(sha256_file, files, threads), strict=True))


def _map_on_daemon_threads(fn: Callable[[Any], Any], items: Sequence[Any], threads: int) -> list[Any]:
    """``[fn(item) for item in items]`` on up to ``threads`` daemon threads; the first error is
    raised. Daemon threads, unlike a ThreadPoolExecutor's, do not hold up the interpreter's exit:
    an extraction that fails while its target is being hashed in the background (the lineage's
    fast start) exits without finishing a hash of 100+ GB first."""
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(items)):
        todo.put(index)
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = fn(items[index])
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors.append(err)

    workers = [threading.Thread(target=work, daemon=True, name=f"hash-{i}") for i in range(min(threads, len(items)))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


def target_identity(model_dir: str | Path, *, hash_weights: bool = True) -> dict[str, Any]:
    """The target's identity: architecture, shapes, config hash and per-weight-file hashes.

    ``hash_weights=False`` skips the weight hashes (an empty dict), for quick checks of a config
    only; extraction always hashes them.
    """
    config = read_config(model_dir)
    lm_config = text_config(config)
    architectures = config.get("architectures") or []
    return {
        "architecture": architectures[0] if architectures else None,
        "model_type": config.get("model_type"),
        "config_sha256": config_sha256(config),
        "weight_files": weight_file_hashes(model_dir) if hash_weights else {},
        "num_hidden_layers": int(lm_config["num_hidden_layers"]),
        "hidden_size": int(lm_config["hidden_size"]),
        "vocab_size": int(lm_config["vocab_size"]),
    }


def identity_model(
    model_dir: str | Path,
    *,
    name_or_path: str | None = None,
    dtype: str = "bfloat16",
    weights_sha256: dict[str, str] | None = None,
) -> TargetIdentity:
    """:func:`target_identity` as the lineage's :class:`hsstore.TargetIdentity` (``name_or_path``:
    what the user named, default the directory; ``dtype``: the compute dtype of extraction;
    ``weights_sha256``: :func:`weight_file_hashes` of the directory when already computed)."""
    found = target_identity(model_dir, hash_weights=weights_sha256 is None)
    if weights_sha256 is not None:
        found["weight_files"] = dict(weights_sha256)
    return TargetIdentity(
        name_or_path=str(model_dir) if name_or_path is None else name_or_path,
        architecture=found["architecture"] or "",
        model_type=found["model_type"] or "",
        config_sha256=found["config_sha256"],
        weights_sha256=found["weight_files"],
        num_hidden_layers=found["num_hidden_layers"],
        hidden_size=found["hidden_size"],
        vocab_size=found["vocab_size"],
        dtype=dtype,
    )


def read_chat_template(model_dir: str | Path) -> str | None:
    """The default chat template text in the order transformers looks for it, or None."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config_path = model_dir / "tokenizer_config.json"
    if config_path.exists():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
    json_path = model_dir / "chat_template.json"
    if json_path.exists():
        template = json.loads(json_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def chat_template_sha256(template: str | None) -> str | None:
    """Hash of a chat template's text (pass ``tokenizer.chat_template`` or read_chat_template())."""
    return None if template is None else sha256_bytes(template.encode("utf-8"))


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """Hash of the tokenizer files that exist in ``tokenizer_dir`` (chat template excluded)."""
    tokenizer_dir = Path(tokenizer_dir)
    parts: list[tuple[str, str]] = []
    for name in _TOKENIZER_FILES:
        path = tokenizer_dir / name
        if not path.exists():
            continue
        if name == "tokenizer_config.json":
            config = json.loads(path.read_text(encoding="utf-8"))
            config.pop("chat_template", None)
            parts.append((name, sha256_bytes(canonical_json(config))))
        else:
            parts.append((name, sha256_file(path)))
    if not parts:
        raise FileNotFoundError(
            f"{tokenizer_dir} holds none of the tokenizer files {', '.join(_TOKENIZER_FILES)}"
        )
    return sha256_bytes(canonical_json(parts))
