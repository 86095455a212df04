"""What the trainer logs: per-window sums kept on the device, reduced over ranks at log steps.

Nothing here forces a host sync per step: the objective's per-depth sums are added on the device,
and only a log step (every ``log_every`` steps) copies one flat tensor to the host, after an
all-reduce over ranks. Throughput is measured over the window's wall time, which that copy makes
exact (the device has finished the window's work when it returns).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipelines.train.distributed import Distributed, all_reduce_
from pipelines.train.objective import ObjectiveOutput


@dataclass(frozen=True)
class StageMetrics:
    """What a training stage's logs call their numbers, beyond loss and per-depth accuracy."""

    accuracy_label: str = "acc"  # how the summary names the per-depth accuracy
    accuracy_alias: str | None = None  # also log the accuracy under this key
    loss_mean_key: str | None = None  # also log the per-depth loss sums' means under this key


DRAFT_METRICS = StageMetrics()
# Stage 2: accuracy is candidate recall@K (the full head's top-1 among the low-rank head's top K),
# and the loss sums are KL(full || low-rank).
CANDIDATE_HEAD_METRICS = StageMetrics(accuracy_label="recall@K", accuracy_alias="recall", loss_mean_key="kl")


class MetricsWindow:
    """Sums since the last log line: loss, per-depth matches and counts (and the per-depth loss
    sums where the stage logs them) on the device; tokens, padding and data-wait seconds on the host."""

    def __init__(self, metrics: StageMetrics = DRAFT_METRICS) -> None:
        self.metrics = metrics
        self.started = time.perf_counter()
        self.reduced_totals: dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        self.device_sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.tokens = 0
        self.padding = 0
        self.wait_s = 0.0
        self.grad_norm: torch.Tensor | None = None

    def add_micro_batch(self, loss: torch.Tensor, out: ObjectiveOutput, num_tokens: int, num_padding: int,
                        wait_s: float) -> None:
        values = {
            "loss": loss.detach().double().reshape(1),
            "correct": torch.stack(out.correct).double(),
            "count": torch.stack(out.counts).double(),
        }
        if self.metrics.loss_mean_key is not None:
            values[self.metrics.loss_mean_key] = torch.stack([s.detach() for s in out.loss_sums]).double()
        for key, value in values.items():
            self.device_sums[key] = self.device_sums[key] + value if key in self.device_sums else value
        self.tokens += num_tokens
        self.padding += num_padding
        self.wait_s += wait_s

    def end_step(self, grad_norm: torch.Tensor) -> None:
        self.steps += 1
        self.grad_norm = grad_norm.detach()

    def reduce(self, step: int, lr: float, epoch: int, dist_state: Distributed) -> dict[str, Any]:
        """One metrics record over all ranks (a host sync); starts the next window."""
        keys = list(self.device_sums)  # insertion order: loss, correct, count, then the stage's
        device = self.device_sums["loss"].device
        grad_norm = self.grad_norm if self.grad_norm is not None else torch.zeros(())
        host = torch.tensor([self.tokens, self.padding, self.wait_s], dtype=torch.float64, device=device)
        flat = torch.cat([self.device_sums[k].reshape(-1) for k in keys] + [host])
        flat = all_reduce_(flat, dist_state).cpu()
        grad_norm_value = float(grad_norm)
        now = time.perf_counter()
        wall_s, self.started = now - self.started, now
        parts, offset = {}, 0
        for k in keys:
            n = self.device_sums[k].numel()
            parts[k] = flat[offset : offset + n]
            offset += n
        tokens, padding, wait_s = flat[offset:].tolist()
        # Over all ranks: tokens, padding and wait add up; wall time is this rank's.
        self.reduced_totals = {"tokens": int(tokens), "padding": int(padding), "wait_s": wait_s, "wall_s": wall_s}
        count = parts["count"].clamp(min=1)
        accuracy = [round(float(x), 6) for x in parts["correct"] / count]
        record: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "lr": lr,
            "loss": float(parts["loss"].sum()) / max(self.steps, 1),
            "acc": accuracy,
            "positions": [int(x) for x in parts["count"]],
            "tokens": int(tokens),
            "tokens_per_s": tokens / max(wall_s, 1e-9),
            # wait_s is summed over ranks, each of which ran for wall_s.
            "data_wait_frac": wait_s / max(wall_s * dist_state.world_size, 1e-9),
            "padding_frac": padding / max(tokens + padding, 1),
            "grad_norm": grad_norm_value,
            "wall_s": wall_s,
        }
        if self.metrics.accuracy_alias is not None:
            record[self.metrics.accuracy_alias] = accuracy
        if self.metrics.loss_mean_key is not None:
            key = self.metrics.loss_mean_key
            record[key] = [round(float(x), 6) for x in parts[key] / count]
        self.reset()
        return record


def append_record(record: dict[str, Any], metrics_path: Path) -> None:
    with metrics_path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def summary_text(summary: dict[str, Any], accuracy_label: str = DRAFT_METRICS.accuracy_label) -> str:
    """The three lines printed at the end of a run (``accuracy_label``: the stage's name for it)."""
    acc = summary["final_acc"] or []
    what = accuracy_label
    lines = [
        f"{'stopped' if summary['interrupted'] else 'done'}: {summary['steps']}/{summary['total_steps']} steps, "
        f"{summary['tokens']} tokens, {summary['tokens_per_s']:.0f} tokens/s, "
        f"data wait {100 * summary['data_wait_frac']:.1f}%, padding {100 * summary['padding_frac']:.1f}%",
        f"final loss {summary['final_loss']}, per-depth {what} " + " ".join(f"{a:.3f}" for a in acc),
        f"{'checkpoint' if summary['interrupted'] else 'final checkpoint'}: {summary['checkpoint']}",
    ]
    return "\n".join(lines)
