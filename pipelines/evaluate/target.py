"""The target side of speculative decoding: a transformers causal LM with a KV cache it owns.

:class:`TargetModel` runs the target one call at a time (batch size 1), keeps a
``transformers.DynamicCache`` across calls, and hands back what the draft needs: the logits of
every new position and the auxiliary hidden states (``hidden_states[i]`` = the input of decoder
layer ``i``, index 0 = the embeddings; the convention in docs/design.md).

Tree verification feeds the root and all draft nodes in ONE forward with a custom 4D attention
mask over ``[cache + tree]`` and depth-based position ids. transformers 5.x passes a 4D mask
through untouched (``masking_utils`` returns it as-is), but the attention kernels read it
differently: sdpa accepts bool or additive float masks, eager *adds* the mask to the scores. We
therefore always pass an additive float mask in the model dtype (0 = may attend, dtype min =
masked), which both kernels treat identically. FlashAttention kernels cannot take an arbitrary
mask and are refused. After verification :meth:`TargetModel.keep` gathers the accepted path's
KV entries (root first) and drops the rest, so the cache holds exactly what sequential decoding
would have produced.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hsstore.aux_layers import check_aux_layer_ids
from hsstore.errors import AuxLayerError, HsstoreError

# Attention implementations that honour a custom additive 4D mask.
MASKABLE_ATTENTION = ("sdpa", "eager")


class TargetModelError(HsstoreError, ValueError):
    """The target cannot be used for tree verification (attention kernel, cache type, ...)."""


@dataclass
class TargetOutput:
    """What one target call returns for its new positions."""

    logits_QV: torch.Tensor  # float32 logits of every new position, [Q, V]
    aux_QKH: torch.Tensor  # aux hidden states of every new position, [Q, K, H] (model dtype)


def resolve_dtype(name: str) -> torch.dtype:
    """Map a recipe dtype name onto torch; ``auto`` is resolved by the caller."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise TargetModelError(f"dtype {name!r} is not one of {sorted(table)}")
    return table[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings are honest on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vocab_size_of(model: torch.nn.Module) -> int:
    """Rows of the output projection (what the draft's vocabulary must match)."""
    return int(model.get_output_embeddings().weight.shape[0])


def load_causal_lm(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from a local directory, with an attention kernel that takes masks."""
    from transformers import AutoModelForCausalLM

    if attn_implementation not in MASKABLE_ATTENTION:
        raise TargetModelError(
            f"attn_implementation {attn_implementation!r} cannot take a custom tree mask; "
            f"use one of {MASKABLE_ATTENTION}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


class TargetModel:
    """A causal LM run with its own DynamicCache, capturing aux hidden states on every call."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int]) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in MASKABLE_ATTENTION:
            raise TargetModelError(
                f"target attention implementation {impl!r} cannot take a custom tree mask; "
                f"load the target with attn_implementation in {MASKABLE_ATTENTION}"
            )
        self.num_layers = int(self.config.num_hidden_layers)
        try:
            # The same range extraction accepts: 0..L, L being the final norm's output, which is
            # also what transformers returns as hidden_states[L].
            self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, self.num_layers, what="aux layer ids")
        except AuxLayerError as err:
            raise TargetModelError(str(err)) from err
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.cache = None
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name
        # still works there with a warning); 5.17 only knows the old one.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.forward_seconds = 0.0
        self.num_forwards = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        aux_layer_ids: list[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attn_implementation: str = "sdpa",
    ) -> TargetModel:
        """Load any ``AutoModelForCausalLM`` directory for verification."""
        return cls(load_causal_lm(path, dtype, device, attn_implementation), aux_layer_ids)

    @property
    def vocab_size(self) -> int:
        return vocab_size_of(self.model)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def seq_length(self) -> int:
        """Number of positions held in the KV cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        """Start a new sequence: a fresh cache whose layers must all be plain (croppable) ones."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(getattr(cache, "layers", [])):
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise TargetModelError(
                    f"target cache layer {i} is {type(layer).__name__}; tree verification needs "
                    "full-attention layers (sliding-window and linear-attention caches cannot "
                    "be gathered along an accepted path)"
                )
        self.cache = cache

    def input_embeddings(self) -> torch.Tensor:
        """The target's token embedding matrix ``[V, H]`` (drafts share it)."""
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def forward(
        self,
        input_ids_Q: torch.Tensor,
        position_ids_Q: torch.Tensor | None = None,
        tree_mask_QQ: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> TargetOutput:
        """Run the new tokens against the cache; they are appended to it.

        ``tree_mask_QQ`` (bool, True = may attend) says which new tokens see which; every new
        token sees the whole cache. ``None`` means causal among the new tokens.
        ``last_logits_only`` skips the vocabulary projection of all but the last position (a
        prefill needs one row; for a 150k vocabulary the rest would cost GBs).
        """
        if self.cache is None:
            self.reset()
        past = self.seq_length
        num_new = int(input_ids_Q.shape[0])
        if position_ids_Q is None:
            position_ids_Q = torch.arange(past, past + num_new, device=self.device)
        kwargs: dict[str, object] = {}
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        if tree_mask_QQ is not None:
            kwargs["attention_mask"] = self._additive_mask(tree_mask_QQ, past)
        start = time.perf_counter()
        out = self.model(
            input_ids=input_ids_Q.to(self.device)[None],
            position_ids=position_ids_Q.to(self.device)[None],
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kwarg: self.cache},
            **kwargs,
        )
        aux_QKH = torch.stack([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=1)
        logits_QV = out.logits[0].float()
        synchronize(self.device)
        self.forward_seconds += time.perf_counter() - start
        self.num_forwards += 1
        if self.seq_length != past + num_new:
            raise TargetModelError(
                f"the target cache grew from {past} to {self.seq_length}, expected {past + num_new}: "
                "this transformers version did not update the DynamicCache in place"
            )
        return TargetOutput(logits_QV=logits_QV, aux_QKH=aux_QKH)

    def _additive_mask(self, tree_mask_QQ: torch.Tensor, past: int) -> torch.Tensor:
        """``[1, 1, Q, past + Q]`` float mask: the cache is visible, the tree as given."""
        num_new = tree_mask_QQ.shape[0]
        allowed = torch.ones(num_new, past + num_new, dtype=torch.bool, device=self.device)
        allowed[:, past:] = tree_mask_QQ.to(self.device)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    def keep(self, num_prefix: int, kept_new_Q: torch.Tensor) -> None:
        """Keep the first ``num_prefix`` cache positions plus the given new ones, in that order.

        ``kept_new_Q`` indexes the positions appended by the last call (0 = its first token):
        the accepted root-to-node path. Their KV entries were computed with the right positions
        and with attention to exactly their ancestors, so they equal sequential decoding's.
        """
        assert self.cache is not None
        index = torch.cat(
            [
                torch.arange(num_prefix, device=self.device),
                num_prefix + kept_new_Q.to(self.device, torch.long),
            ]
        )
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
