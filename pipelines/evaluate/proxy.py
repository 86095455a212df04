"""The offline proxy: the draft's per-depth TTT accuracy on stored features, no target run.

It is what the trainer logs (argmax(draft) == argmax(teacher) at each TTT depth, with the
trainer's own masks), computed here on samples of a store so that it can be printed next to the
acceptance length really measured: users see how far the cheap number is off. The trainer uses
every sample of its store, so a held-out figure needs a store extracted from data the draft did
not train on (or a ``fraction`` of one it did not see); the report names the store it used.

From accuracies ``a_0..a_{L-1}`` the usual chain estimate is ``1 + sum_d prod_{i<d} a_i``: each
depth is taken as accepted with its accuracy given the previous ones were. It ignores that
greedy verification checks the target's argmax over the FULL vocabulary, while positions whose
argmax lies outside the draft vocabulary are simply not scored here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

import hsstore
from hsstore.aux_layers import AUX_HIDDEN_STATES
from hsstore.errors import LineageMismatchError, RecipeError
from pipelines.evaluate.recipe import DecodeSetting, ProxyConfig
from pipelines.models.eagle3 import Eagle3Draft


def _in_fraction(sample_id: str, fraction: float) -> bool:
    """A stable pseudo-random subset: the first 8 bytes of sha256(sample_id) below the fraction."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def predicted_chain_length(accuracies: list[float | None], num_draft_tokens: int) -> float:
    """``1 + sum_{d=1..k} prod_{i<d} a_i``, reusing the deepest accuracy past the unroll."""
    known = [a for a in accuracies if a is not None]
    if not known:
        return 1.0
    expected, survive = 1.0, 1.0
    for d in range(num_draft_tokens):
        survive *= known[min(d, len(known) - 1)]
        expected += survive
    return expected


def open_proxy_store(config: ProxyConfig, draft: Eagle3Draft | None = None) -> hsstore.Store:
    """The proxy's store, checked: it exists and (given the draft) holds the draft's aux layers.

    The evaluation calls this before decoding anything, so that a wrong ``proxy.store`` fails in
    a second instead of after every prompt of every setting (whose results would be lost)."""
    import hsstore

    try:
        store = hsstore.open_store(config.store)
    except (hsstore.StoreNotFoundError, hsstore.ManifestError) as err:
        raise RecipeError(f"proxy.store: {err}") from err
    if draft is not None:
        check_proxy_layers(store, config, draft)
    return store


def check_proxy_layers(store: hsstore.Store, config: ProxyConfig, draft: Eagle3Draft) -> None:
    stored_aux = list(store.lineage.aux_layer_ids)
    if stored_aux != list(draft.config.aux_layer_ids):
        raise LineageMismatchError(
            f"{config.store}: lineage aux_layer_ids {stored_aux} differ from the draft's "
            f"{draft.config.aux_layer_ids}; the proxy needs a store of the layers the draft reads"
        )


@torch.no_grad()
def offline_proxy(
    draft: Eagle3Draft,
    config: ProxyConfig,
    target_dir: str,
    settings: list[DecodeSetting],
    device: torch.device,
    store: hsstore.Store | None = None,
) -> dict[str, Any]:
    """Per-depth TTT accuracy of ``draft`` on (a part of) ``config.store`` (``store``: that store,
    opened by :func:`open_proxy_store` already)."""
    from pipelines.train.lineage_check import choose_teacher
    from pipelines.train.target_heads import load_target_heads
    from pipelines.train.teacher import build_teacher
    from pipelines.train.teacher_mode import TeacherMode
    from pipelines.train.ttt import ttt_forward

    store = open_proxy_store(config, draft) if store is None else store
    teacher_mode = choose_teacher(store, "auto")
    lm_head = None
    if teacher_mode == TeacherMode.FINAL_HIDDEN:
        lm_head = load_target_heads(target_dir).lm_head_VH.to(device)
    features = [AUX_HIDDEN_STATES, *teacher_mode.features]
    sample_ids = store.samples.column("sample_id").to_pylist()
    chosen = [i for i, sid in enumerate(sample_ids) if _in_fraction(sid, config.fraction)]
    if config.max_samples is not None:
        chosen = chosen[: config.max_samples]
    if not chosen:
        raise LineageMismatchError(
            f"{config.store}: proxy.fraction={config.fraction} selects none of its {len(sample_ids)} samples"
        )
    dtype = next(draft.parameters()).dtype
    correct = torch.zeros(config.ttt_length, dtype=torch.long)
    counted = torch.zeros(config.ttt_length, dtype=torch.long)
    for index in chosen:
        sample = store.read_sample(index, features, device=device)
        input_ids = torch.as_tensor(sample["input_ids"], dtype=torch.long, device=device)[None]
        loss_mask = torch.as_tensor(sample["loss_mask"], device=device).bool()[None]
        batch = {name: sample[name][None] for name in features if name != AUX_HIDDEN_STATES}
        teacher = build_teacher(
            teacher_mode, batch, d2t=draft.d2t, t2d=draft.t2d, lm_head_VH=lm_head
        )
        out = ttt_forward(
            draft,
            sample[AUX_HIDDEN_STATES][None].to(dtype),
            input_ids,
            torch.arange(input_ids.shape[1], device=device)[None],
            loss_mask,
            teacher.probs_BTV,
            teacher.valid_BT,
            ttt_length=config.ttt_length,
            attention="eager",  # one sample at a time, every length different: no compiled kernel per shape
        )
        correct += torch.stack(out.step_correct).cpu()
        counted += torch.stack([c.to(torch.long) for c in out.step_counts]).cpu()
    accuracy = [float(c) / float(n) if n else None for c, n in zip(correct, counted, strict=True)]
    predicted = {
        s.label: predicted_chain_length(accuracy, s.depth)
        for s in settings
        if s.num_draft_tokens is not None and s.temperature == 0.0
    }
    return {
        "store": config.store,
        "fraction": config.fraction,
        "num_samples": len(chosen),
        "teacher": teacher_mode,
        "ttt_length": config.ttt_length,
        "accuracy_per_depth": accuracy,
        "scored_per_depth": counted.tolist(),
        "predicted_acceptance_length": predicted,
    }
