"""The EAGLE-3 / EAGLE-4 draft: one Llama-style decoder layer over fused target hidden states.

Training (TTT unroll), export (vLLM/SGLang layout) and evaluation (chain and tree decoding) all use
this one module; see docs/draft-model.md for the contract. Parameter names equal the serving
layout's weight names (``fc.weight``, ``midlayer.self_attn.q_proj.weight``, ...), so export is a
rename-free copy minus ``embed_tokens``.

Data flow at one position t (docs/design.md): ``h = fc(cat(aux_t))`` (or the draft's own previous
output at TTT depth > 0), ``x = cat([input_layernorm(embed(token_{t+1})), hidden_norm(h)])`` (2H,
embeddings first), attention on x with the residual being h itself, a SiLU MLP, and the pre-norm
output is what the next depth gets back as h. Logits are ``lm_head(norm(out))`` over the draft
vocabulary; ``d2t`` maps a draft id to its target id.

EAGLE-3.1 (``fc_norm``, ``norm_output``): each aux state is RMS-normed before fc, and the next
depth gets ``norm(out)`` (what lm_head reads) instead of ``out``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.models.eagle3_config import Eagle3Config  # noqa: F401 (re-exported)
from pipelines.models.ttt_attention import (
    EagerTTTAttention,
    FlexTTTAttention,
    SegmentedTTTAttention,
)

KVCache = tuple[torch.Tensor, torch.Tensor]
TTTAttention = EagerTTTAttention | SegmentedTTTAttention | FlexTTTAttention


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At least float32 statistics like the engines, whatever the compute dtype.
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: Eagle3Config, device: torch.device | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies in float64 (recomputed per call: a module buffer would be cast to
    bf16 by ``.to(dtype)`` and lose the precision long positions need)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    )
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") == "llama3":
        # Llama 3.1's frequency-dependent rescaling, as in transformers' _compute_llama3_parameters.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(
    x_BNTD: torch.Tensor, position_ids_BT: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE (the Llama/HF convention, not interleaved pairs)."""
    # At least float32 angles (as the engines compute them), float64 for float64 models.
    dtype = torch.promote_types(x_BNTD.dtype, torch.float32)
    angles_BTF = position_ids_BT[..., None].to(dtype) * inv_freq.to(dtype)
    emb_BTD = torch.cat([angles_BTF, angles_BTF], dim=-1)
    cos, sin = emb_BTD.cos()[:, None], emb_BTD.sin()[:, None]
    x1, x2 = x_BNTD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BNTD.to(dtype) * cos + rotated.to(dtype) * sin).to(x_BNTD.dtype)


def causal_mask(
    num_queries: int, num_past: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Bool [Q, S_past + Q]: query j (cache index S_past + j) sees keys k <= S_past + j, and with a
    window only keys with ``query_index - k < sliding_window`` (HF/Mistral convention)."""
    q_idx = torch.arange(num_queries, device=device)[:, None] + num_past
    k_idx = torch.arange(num_past + num_queries, device=device)[None, :]
    mask = k_idx <= q_idx
    if sliding_window is not None:
        mask &= q_idx - k_idx < sliding_window
    return mask


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        n_heads, n_kv, hd, h = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        # q/k/v read the 2H concatenation [input_layernorm(embed), hidden_norm(h)].
        self.q_proj = nn.Linear(2 * h, n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, n_kv * hd, bias=False)
        self.o_proj = nn.Linear(n_heads * hd, h, bias=False)

    def forward(
        self,
        x_BTC: torch.Tensor,
        position_ids_BT: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: KVCache | None,
        ttt: TTTAttention | None = None,
        depth: int = 0,
    ) -> tuple[torch.Tensor, KVCache]:
        cfg = self.config
        B, T, _ = x_BTC.shape
        q = self.q_proj(x_BTC).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTC).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTC).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        inv_freq = rope_inv_freq(cfg, x_BTC.device)
        q, k = apply_rope(q, position_ids_BT, inv_freq), apply_rope(k, position_ids_BT, inv_freq)
        if ttt is not None:  # training-time test: the unroll's attention owns the keys
            out = ttt.attend(q, k, v, depth)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], dim=2)
            v = torch.cat([past_key_values[1], v], dim=2)
        if attention_mask is None:
            mask = causal_mask(T, k.shape[2] - T, cfg.sliding_window, x_BTC.device)
        else:
            if attention_mask.shape != (B, T, k.shape[2]):
                raise ValueError(
                    f"attention_mask must be bool [B={B}, Q={T}, S_past+Q={k.shape[2]}], "
                    f"got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()[:, None]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, dim=1),
            v.repeat_interleave(groups, dim=1),
            attn_mask=mask,
        )
        out = out.transpose(1, 2).reshape(B, T, cfg.num_attention_heads * cfg.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The EAGLE-3 ``midlayer``: vLLM's/SGLang's Eagle3 LlamaDecoderLayer, residual = incoming h."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.mlp = MLP(config)

    def forward(
        self,
        embeds_BTD: torch.Tensor,
        hidden_BTD: torch.Tensor,
        position_ids_BT: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: KVCache | None,
        ttt: TTTAttention | None = None,
        depth: int = 0,
    ) -> tuple[torch.Tensor, KVCache]:
        x = torch.cat([self.input_layernorm(embeds_BTD), self.hidden_norm(hidden_BTD)], dim=-1)
        attn, kv = self.self_attn(x, position_ids_BT, attention_mask, past_key_values, ttt, depth)
        h = hidden_BTD + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class CandidateHead(nn.Module):
    """EAGLE-4 stage 2: logits ~= up_proj(down_proj(norm(h))), a rank-r stand-in for lm_head whose
    top K candidates the server rescores exactly with the full head."""

    def __init__(self, hidden_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.down_proj = nn.Linear(hidden_size, rank, bias=False)  # weight [r, H]
        self.up_proj = nn.Linear(rank, draft_vocab_size, bias=False)  # weight [V_draft, r]

    def forward(self, normed_BTD: torch.Tensor) -> torch.Tensor:
        return self.up_proj(self.down_proj(normed_BTD))


@dataclass
class Eagle3Output:
    hidden_BTD: torch.Tensor  # the h fed back at the next depth: pre-norm (post-norm with norm_output)
    past_key_values: KVCache | None  # (k, v) [B, kv_heads, S, head_dim] with RoPE applied


# ---------------------------------------------------------------------------------------------
# The draft


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        # Copied from the target and frozen; the engines share the target's, so it is not exported.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        # EAGLE-3.1: one RMSNorm per aux layer over its H_t features, before the concatenation.
        self.fc_norm: nn.ModuleList | None = None
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                for _ in range(config.num_aux_layers)
            )
        self.fc = nn.Linear(
            config.num_aux_layers * config.target_hidden_size, config.hidden_size, bias=False
        )
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.candidate_head: CandidateHead | None = None
        if config.candidate_rank is not None:
            self.candidate_head = CandidateHead(
                config.hidden_size, config.draft_vocab_size, config.candidate_rank
            )
        # Identity-prefix vocabulary until calibrated (pipelines.train.vocab fills these).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a calibrated draft vocabulary (shapes checked against the config)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"draft_vocab_size={self.config.draft_vocab_size} / vocab_size={self.config.vocab_size}"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the K aux states, layer-major: [B, T, K, H_t] or [B, T, K*H_t] -> [B, T, H]
        (EAGLE-3.1: each aux state RMS-normed first, ``fc_norm``)."""
        cfg = self.config
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            if aux.dim() != 4:
                aux = aux.unflatten(-1, (cfg.num_aux_layers, cfg.target_hidden_size))
            aux = torch.stack([norm(aux[..., k, :]) for k, norm in enumerate(self.fc_norm)], dim=-2)
        if aux.dim() == 4:
            aux = aux.flatten(-2)
        return self.fc(aux)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        hidden_BTD: torch.Tensor,
        position_ids_BT: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        ttt: TTTAttention | None = None,
        depth: int = 0,
    ) -> Eagle3Output:
        """One draft step. ``attention_mask`` None = causal over cache + new keys (and the sliding
        window when configured); otherwise bool [B, Q, S_past + Q], True = may attend, used as
        given (the caller applies any window to explicit masks).

        TTT mode (training, ``pipelines.train.ttt``): ``ttt`` (``pipelines.models.ttt_attention``)
        holds the unroll's keys and does depth ``depth``'s attention (the depth-0 keys of the
        same document plus each position's own keys of depths 1..depth); masks and caches passed
        here are ignored, and the returned cache is this depth's (k, v) alone."""
        embeds = self.embed_tokens(input_ids_BT).to(hidden_BTD.dtype)
        hidden, kv = self.midlayer(
            embeds, hidden_BTD, position_ids_BT, attention_mask, past_key_values, ttt, depth
        )
        if self.config.norm_output:  # EAGLE-3.1: the next depth gets the final-normed hidden
            hidden = self.norm(hidden)
        return Eagle3Output(hidden_BTD=hidden, past_key_values=kv if use_cache else None)

    def head_input(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """What lm_head (and the candidate head) read from a forward's ``hidden_BTD``: its final
        norm, or the hidden itself when ``norm_output`` already normed it (normed once, as the
        engines do)."""
        return hidden_BTD if self.config.norm_output else self.norm(hidden_BTD)

    def compute_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Logits over the DRAFT vocabulary from a forward's ``hidden_BTD``."""
        return self.lm_head(self.head_input(hidden_BTD))

    def compute_candidate_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Low-rank (EAGLE-4 stage 2) logits over the draft vocabulary."""
        if self.candidate_head is None:
            raise ValueError("this draft has no candidate head (config.candidate_rank is None)")
        return self.candidate_head(self.head_input(hidden_BTD))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
