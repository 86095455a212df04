"""The three tensors of the target that draft training needs, read by name from its safetensors.

A draft is trained against the target's output distribution, rebuilt from the stored post-norm
``final_hidden_state`` through the target's ``lm_head``; the draft's token embedding is a frozen
copy of the target's ``embed_tokens``. Everything else in the target (the transformer stack, GBs
for real models) is never read: :func:`load_target_heads` opens the safetensors files lazily and
pulls exactly these tensors, following ``model.safetensors.index.json`` when the weights are sharded.

Tied embeddings (``tie_word_embeddings: true``, or a checkpoint without an ``lm_head`` tensor) share
one matrix for both roles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsstore.errors import HsstoreError

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensor names by role, in the order they are tried. Llama/Qwen/Mistral/Gemma-style causal LMs use
# the first; multimodal wrappers nest the language model one level down.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "norm.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


class TargetWeightsError(HsstoreError, FileNotFoundError):
    """The target directory lacks safetensors weights or one of the tensors training needs."""


@dataclass
class TargetHeads:
    """The target's token embedding, final norm and vocabulary projection (frozen, never trained).

    ``lm_head_VH`` is ``embed_tokens_VH`` itself (same storage) when the target ties them.
    """

    embed_tokens_VH: torch.Tensor
    norm_weight_H: torch.Tensor
    lm_head_VH: torch.Tensor
    norm_eps: float
    tied: bool
    tensor_names: dict[str, str]

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head_VH.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head_VH.shape[1])

    def to(self, device: str | torch.device) -> TargetHeads:
        embed = self.embed_tokens_VH.to(device)
        return TargetHeads(
            embed_tokens_VH=embed,
            norm_weight_H=self.norm_weight_H.to(device),
            lm_head_VH=embed if self.tied else self.lm_head_VH.to(device),
            norm_eps=self.norm_eps,
            tied=self.tied,
            tensor_names=dict(self.tensor_names),
        )

    def apply_norm(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm (Llama/Qwen form: float32 statistics, weight times normed).

        Only needed for a store that captured the pre-norm state; the docs/design.md convention stores
        the post-norm state, which goes straight into :meth:`logits`.
        """
        import torch

        work = hidden_TH.to(torch.float32)
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return self.norm_weight_H.to(hidden_TH.dtype) * work.to(hidden_TH.dtype)

    def logits(self, final_hidden_TH: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from the post-norm final state (what the target's lm_head does)."""
        return final_hidden_TH @ self.lm_head_VH.to(final_hidden_TH.dtype).T


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (header only, no tensor data)."""
    index_path = target_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise TargetWeightsError(f"{index_path}: not a safetensors index (no weight_map): {err}") from err
        return {name: target_dir / file for name, file in weight_map.items()}
    single = target_dir / SINGLE_FILE
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
    raise TargetWeightsError(
        f"{target_dir}: no {SINGLE_FILE} or {INDEX_FILE}; the trainer reads the target's "
        "embed_tokens and lm_head from safetensors (convert .bin checkpoints with save_pretrained)"
    )


def _pick(names: tuple[str, ...], files: dict[str, Path]) -> str | None:
    return next((name for name in names if name in files), None)


def _read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    path = files[name]
    if not path.exists():
        raise TargetWeightsError(f"{path}: named by the index for tensor {name!r} but missing")
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def _read_config(target_dir: Path) -> dict[str, Any]:
    path = target_dir / "config.json"
    if not path.exists():
        raise TargetWeightsError(f"{target_dir}: no config.json (is this a Hugging Face model directory?)")
    config = json.loads(path.read_text(encoding="utf-8"))
    # Multimodal configs keep the language model's settings under text_config.
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def load_target_heads(target_dir: str | Path, dtype: torch.dtype | None = None) -> TargetHeads:
    """Read ``embed_tokens``, the final norm and ``lm_head`` from a local target directory.

    ``dtype`` casts the matrices (the norm stays as stored); ``None`` keeps the checkpoint's dtype.
    """
    target_dir = Path(target_dir)
    config = _read_config(target_dir)
    files = _weight_files(target_dir)
    embed_name = _pick(EMBED_NAMES, files)
    norm_name = _pick(NORM_NAMES, files)
    head_name = _pick(LM_HEAD_NAMES, files)
    if embed_name is None:
        raise TargetWeightsError(f"{target_dir}: no token embedding tensor (looked for {', '.join(EMBED_NAMES)})")
    if norm_name is None:
        raise TargetWeightsError(f"{target_dir}: no final norm tensor (looked for {', '.join(NORM_NAMES)})")
    tied = bool(config.get("tie_word_embeddings", False)) or head_name is None
    embed = _read_tensor(files, embed_name)
    if dtype is not None:
        embed = embed.to(dtype)
    if tied:
        lm_head, head_name = embed, embed_name
    else:
        assert head_name is not None
        lm_head = _read_tensor(files, head_name)
        if dtype is not None:
            lm_head = lm_head.to(dtype)
    if lm_head.shape != embed.shape:
        raise TargetWeightsError(
            f"{target_dir}: {head_name} has shape {tuple(lm_head.shape)} but {embed_name} has "
            f"{tuple(embed.shape)}; the trainer expects [vocab, hidden] for both"
        )
    norm = _read_tensor(files, norm_name)
    eps = config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-6))
    return TargetHeads(
        embed_tokens_VH=embed,
        norm_weight_H=norm,
        lm_head_VH=lm_head,
        norm_eps=float(eps),
        tied=tied,
        tensor_names={"embed_tokens": embed_name, "norm": norm_name, "lm_head": head_name},
    )
