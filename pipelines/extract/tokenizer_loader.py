"""Loading the target's tokenizer for planning, without torch where the checkpoint allows it.

transformers' ``AutoTokenizer`` imports torch whenever torch is installed, before it reads a file:
``transformers.models.auto.tokenization_auto`` imports ``configuration_utils`` (it reads the model
config to pick the tokenizer class), which imports ``modeling_rope_utils``, whose module body runs
``if is_torch_available(): import torch``. The tokenizer classes themselves (``TokenizersBackend``
in ``transformers.tokenization_utils_tokenizers``, per-model classes such as ``Qwen2Tokenizer``)
import only the ``tokenizers`` library. So where the class AutoTokenizer would pick is known from
the checkpoint's two JSON files, planning loads that class directly: the object AutoTokenizer
returns, so the same ids, loss masks and rejections, without torch's import (seconds and ~250 MB in
the driver and in every tokenizing process). Any other checkpoint loads through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# (config.json ``model_type``, tokenizer_config.json ``tokenizer_class``) -> the class that
# transformers 5's AutoTokenizer loads for that pair, by its name in the ``transformers`` namespace.
# AutoTokenizer's choice depends on the model type as well as on the declared class: a model type
# on its list of Hub configs it distrusts gets its own class whatever the file says ("qwen2"
# declaring TokenizersBackend loads Qwen2Tokenizer), and a class its name no longer exists under
# maps to another ("PreTrainedTokenizerFast" is TokenizersBackend). Rather than re-deriving that
# choice, this lists the pairs of the targets we extract from (Qwen3 as saved by transformers 5 and
# as published, Llama 3), each checked against AutoTokenizer by tests/pipelines/extract/
# test_tokenizer_loader.py; every other pair goes through AutoTokenizer.
_TORCH_FREE_CLASSES: dict[tuple[str, str], str] = {
    **{
        (model_type, declared): loaded
        for model_type in ("qwen3", "qwen3_moe")
        for declared, loaded in (
            ("TokenizersBackend", "TokenizersBackend"),
            ("PreTrainedTokenizerFast", "TokenizersBackend"),
            ("Qwen2Tokenizer", "Qwen2Tokenizer"),
            ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
        )
    },
    ("llama", "TokenizersBackend"): "TokenizersBackend",
    ("llama", "PreTrainedTokenizerFast"): "TokenizersBackend",
}


def torch_free_tokenizer_class(path: str) -> type[Any] | None:
    """The tokenizer class AutoTokenizer would load from the local directory ``path``, when that
    is known without importing torch; None when only AutoTokenizer can tell."""
    model_dir = Path(path)
    model_config = _read_json(model_dir / "config.json")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    if model_config is None or tokenizer_config is None:
        return None
    # Remote code picks its own classes (a tokenizer's auto_map, or a config class whose
    # model_type need not be the file's).
    if "auto_map" in tokenizer_config or "auto_map" in model_config:
        return None
    name = _TORCH_FREE_CLASSES.get(
        (str(model_config.get("model_type")), str(tokenizer_config.get("tokenizer_class")))
    )
    if name is None:
        return None
    import transformers  # light: the top-level package is lazy and imports no torch itself

    # The table is transformers 5's choice; 4.x picked other classes (Qwen2TokenizerFast, and
    # ``Qwen2Tokenizer`` was the slow one).
    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    # A release without the class under that name: let AutoTokenizer choose.
    return getattr(transformers, name, None)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer AutoTokenizer loads from ``path``, through its class directly where that
    class is known without torch (see the module doc)."""
    tokenizer_class = torch_free_tokenizer_class(path)
    if tokenizer_class is not None:
        return tokenizer_class.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def tokenizer_module(path: str) -> str:
    """The module a process imports to load this tokenizer: a fork server preloads it."""
    tokenizer_class = torch_free_tokenizer_class(path)
    if tokenizer_class is None:
        return "transformers.models.auto.tokenization_auto"
    return str(tokenizer_class.__module__)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
