"""Capture the target's hidden states with forward hooks, for the valid tokens of a padded batch.

Layer convention (docs/design.md): aux layer id ``i`` is ``hidden_states[i]`` of transformers'
``output_hidden_states``: the hidden state *entering* decoder layer ``i`` (``i == 0`` is the
embedding output). It is captured by a forward *pre*-hook on ``layers[i]``. ``i == L`` (one past
the last layer) is what transformers returns as ``hidden_states[L]``: the final norm's output,
for Llama/Qwen/Mistral-style models (checked by the tests against ``output_hidden_states``).

The final state is the post-norm output of the last layer, i.e. what the lm_head multiplies:
a forward hook on the base model's final norm. Only the base model runs (``model.model``); the
vocabulary projection runs only when ``topk`` is asked for, chunked over tokens on the device,
and only the k kept values and ids leave it.

Padding: batches are right-padded (see batching.collate). Only rows' valid prefixes are gathered
(by flat token index), so padded positions never reach a feature; with causal attention a valid
token never attends to a later pad either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hsstore.aux_layers import AUX_HIDDEN_STATES as AUX_FEATURE
from hsstore.aux_layers import FINAL_HIDDEN_STATE as FINAL_FEATURE
from hsstore.aux_layers import TOPK_IDS as TOPK_IDS_FEATURE
from hsstore.aux_layers import TOPK_LOGITS as TOPK_LOGITS_FEATURE
from hsstore.aux_layers import check_aux_layer_ids, is_final_norm_output

# Architectures (``config.model_type``) whose valid tokens' features are the same with and without
# the padding mask under right padding: decoder-only, causal attention (full or sliding window),
# per-token norms and MLPs (per-token expert routing too), rotary positions from 0. Each is
# checked by tests/pipelines/extract/test_capture.py on a tiny random model; add a type here only
# with its test. Others get the mask (``batching.pass_attention_mask: auto``).
MASK_FREE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


def resolve_pass_attention_mask(setting: bool | str | None, model_type: str | None) -> bool:
    """``batching.pass_attention_mask``: ``auto`` (or None) passes the mask only for architectures
    not in :data:`MASK_FREE_MODEL_TYPES`; a bool is taken as given."""
    if isinstance(setting, bool):
        return setting
    if setting not in (None, "auto"):
        raise ValueError(f"pass_attention_mask must be true, false or auto, got {setting!r}")
    return model_type not in MASK_FREE_MODEL_TYPES


def pace_layers(num_layers: int, pieces: int | None = None) -> tuple[int, ...]:
    """Decoder layers, evenly spaced from the first, at which a forward paces the previous batch's
    copies (one piece each; ``pieces`` defaults to sink.COPY_PIECES)."""
    from pipelines.extract.sink import COPY_PIECES

    pieces = min(num_layers, pieces or COPY_PIECES)
    return tuple(sorted({i * num_layers // pieces for i in range(pieces)}))


class UnsupportedModelError(ValueError):
    """The model's decoder layers or final norm cannot be found to hook."""


@dataclass(frozen=True)
class DecoderParts:
    """The modules capture hooks onto, found by name on any HF causal LM."""

    base: nn.Module  # the model without the lm_head (model.model)
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module | None


def find_decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate base model, decoder layers, final norm and lm_head of a causal LM.

    Llama/Qwen/Mistral/Gemma (``model.layers``, ``model.norm``), GPT-2/Falcon style
    (``transformer.h``, ``ln_f``) and OPT style (``decoder.layers``, ``final_layer_norm``).
    """
    base = getattr(model, "base_model", None) or getattr(model, "model", None) or model
    inner = base
    if not hasattr(inner, "layers") and hasattr(inner, "decoder"):
        inner = inner.decoder
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    norm = None
    for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm"):
        norm = getattr(inner, name, None)
        if norm is not None:
            break
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: cannot find decoder layers (layers/h) and final norm "
            "(norm/ln_f/final_layer_norm) on the base model; this architecture is not supported"
        )
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return DecoderParts(base=base, layers=layers, final_norm=norm, lm_head=lm_head)


class HiddenStateCapture:
    """Runs the base model on a padded batch and returns features of the valid tokens, packed.

    Returned tensors stay on the model's device: ``aux_hidden_states`` ``[N, K, H]``,
    ``final_hidden_state`` ``[N, H]``, and with ``topk_k``: ``topk_logits`` ``[N, k]`` (raw logits,
    float32) and ``topk_ids`` ``[N, k]`` (int32); ``N`` is the batch's real token count, rows in
    order. Hooks are attached for each call only.
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int],
        *,
        final_hidden_state: bool = True,
        topk_k: int | None = None,
        topk_chunk_tokens: int = 4096,
        pass_attention_mask: bool = True,
    ) -> None:
        self.model = model
        self.parts = find_decoder_parts(model)
        self.num_layers = len(self.parts.layers)
        if topk_k is not None and self.parts.lm_head is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no lm_head to compute top-k with"
            )
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.final_hidden_state = final_hidden_state
        self.topk_k = topk_k
        self.topk_chunk_tokens = topk_chunk_tokens
        self.pass_attention_mask = pass_attention_mask
        self.softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        self._captured: dict[int | str, torch.Tensor] = {}
        self._handles: list[Any] = []
        # Called as each pace layer starts, when set: the worker's sink copies a piece of the
        # previous batch's features there (sink.ShardSink.pace: spread over the forward, the
        # device-to-host copies do not slow its launches).
        self.on_pace: Callable[[], None] | None = None
        self.pace_layers = pace_layers(self.num_layers)

    def _attach(self) -> None:
        """Hooks live only for the duration of a call: between calls the model is untouched (a
        bare forward of the same model, as the benchmark runs, pays nothing and keeps nothing)."""
        for layer_id in sorted(set(self.aux_layer_ids)):
            if not is_final_norm_output(layer_id, self.num_layers):  # id L comes from the norm hook
                handle = self.parts.layers[layer_id].register_forward_pre_hook(
                    self._pre_hook(layer_id), with_kwargs=True
                )
                self._handles.append(handle)
        self._handles.append(self.parts.final_norm.register_forward_hook(self._norm_hook))
        if self.on_pace is not None:
            for layer_id in self.pace_layers:
                self._handles.append(
                    self.parts.layers[layer_id].register_forward_pre_hook(self._pace_hook)
                )

    def _pre_hook(self, layer_id: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self._captured[layer_id] = hidden

        return hook

    def _pace_hook(self, module: nn.Module, args: tuple) -> None:
        if self.on_pace is not None:
            self.on_pace()

    def _norm_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._captured["final"] = output[0] if isinstance(output, tuple) else output

    def close(self) -> None:
        """Remove any hooks (only left attached if a call was interrupted)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()

    def __enter__(self) -> HiddenStateCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.inference_mode()
    def __call__(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        valid_index_N: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Features of the valid tokens, rows in order.

        ``valid_index_N``: the flat indices (``b * T + t``) of the valid tokens, on the model's
        device. Give it when the mask lives on the host: gathering by a boolean device mask must
        ask the GPU how many tokens it selects, a sync that stalls the CPU once per batch.
        """
        if valid_index_N is None:
            valid_index_N = attention_mask_BT.reshape(-1).nonzero().squeeze(-1)
        self._attach()
        try:
            self.parts.base(
                input_ids=input_ids_BT,
                attention_mask=attention_mask_BT if self.pass_attention_mask else None,
                use_cache=False,
            )
            final_BTD = self._captured["final"]

            def valid(hidden_BTD: torch.Tensor) -> torch.Tensor:
                flat = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
                # A target split over GPUs (placement.py): gather where the index (and the final
                # norm) is. Selecting first would move fewer bytes but needs the index everywhere.
                if flat.device != valid_index_N.device:
                    flat = flat.to(valid_index_N.device, non_blocking=True)
                return flat.index_select(0, valid_index_N)

            features: dict[str, torch.Tensor] = {}
            if self.aux_layer_ids:
                per_layer = [
                    valid(
                        final_BTD if is_final_norm_output(i, self.num_layers) else self._captured[i]
                    )
                    for i in self.aux_layer_ids
                ]
                features[AUX_FEATURE] = torch.stack(per_layer, dim=1)  # [N, K, H]
            final_NH = valid(final_BTD)
            if self.final_hidden_state:
                features[FINAL_FEATURE] = final_NH
            if self.topk_k is not None:
                features[TOPK_LOGITS_FEATURE], features[TOPK_IDS_FEATURE] = self._topk(final_NH)
            return features
        finally:
            self.close()

    def _topk(self, final_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k logits over the full vocabulary, a chunk of tokens at a time (bounded memory)."""
        assert self.parts.lm_head is not None and self.topk_k is not None
        values, ids = [], []
        for chunk_CH in final_NH.split(self.topk_chunk_tokens):
            logits_CV = self.parts.lm_head(chunk_CH).float().to(chunk_CH.device)
            if self.softcap:
                logits_CV = torch.tanh(logits_CV / self.softcap) * self.softcap
            top = logits_CV.topk(self.topk_k, dim=-1)
            values.append(top.values)
            ids.append(top.indices.to(torch.int32))
        return torch.cat(values), torch.cat(ids)
