"""Optional text decoding: the tokenizer the lineage names, loaded lazily (transformers is heavy)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsstore.errors import HsstoreError
from hsstore.extras import import_optional

if TYPE_CHECKING:
    from hsstore.store import Store


def find_tokenizer_dir(store: Store) -> Path | None:
    """The tokenizer directory the lineage names, if it is a local directory.

    Extraction records ``target.name_or_path`` as given, often relative to the directory it ran
    from; that directory is usually an ancestor of a local store, so those are tried too.
    """
    target = store.lineage.target
    if target is None or not target.name_or_path:
        return None
    name = Path(target.name_or_path)
    candidates = [name]
    if not name.is_absolute():
        candidates.append(Path.cwd() / name)
        directory = store.location.local_directory
        if directory is not None:
            candidates += [parent / name for parent in Path(directory).resolve().parents]
    for candidate in candidates:
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            return candidate.resolve()
    return None


def load_tokenizer(store: Store, tokenizer: Any = "auto") -> Any | None:
    """A tokenizer for decoding: an object passes through, a path loads it, ``"auto"`` uses the
    lineage's target when it is a local directory (else ``None``), ``None`` means no decoding."""
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    if tokenizer == "auto":
        found = find_tokenizer_dir(store)
        if found is None:
            return None
        tokenizer = found
    transformers = import_optional("transformers", "decoding tokens (--decode, tokenizer=)")
    return transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer))


def require_tokenizer(store: Store, tokenizer: Any) -> Any:
    loaded = load_tokenizer(store, tokenizer)
    if loaded is None:
        name = store.lineage.target.name_or_path if store.lineage.target else None
        raise HsstoreError(
            f"{store.url}: cannot decode text: the lineage's target {name!r} is not a local "
            "tokenizer directory from here; pass tokenizer=<path or object>"
        )
    return loaded
