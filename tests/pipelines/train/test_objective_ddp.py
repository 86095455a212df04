"""DistributedDataParallel over the objective computes the gradient of one process seeing every
rank's batch: the loss is normalised by the global count of scored positions, and DDP's average
over ranks is undone by the world-size factor in ``objective_loss``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from pipelines.train.distributed import Distributed, all_reduce_, wrap_ddp
from pipelines.train.objective import DraftObjective, objective_loss
from pipelines.train.teacher_mode import TeacherMode
from tests.pipelines.train.test_ttt import packed_batch, ttt_draft


def _inputs():
    draft = ttt_draft()
    aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, [[9, 5], [3, 11]], seed=3)
    # The dense-probabilities teacher mode reads the distribution from the batch's features.
    draft_probs = teacher * valid[..., None]
    features = {"aux_hidden_states": aux, "draft_probs": draft_probs}
    return draft, features, ids, pos, loss_mask, docs


def _grads(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in draft.named_parameters() if p.grad is not None}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_gradients(rank: int, out_dir: str, compile: str) -> None:
    draft, features, ids, pos, loss_mask, docs = _inputs()
    rows = slice(rank, rank + 1)
    state = Distributed(rank=rank, world_size=2)
    objective = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, compile=compile,
                               compile_backend="aot_eager")
    model = wrap_ddp(objective, state)
    out = model({k: v[rows] for k, v in features.items()}, ids[rows], pos[rows], loss_mask[rows], docs[rows])
    counts = all_reduce_(torch.stack(out.counts).to(torch.float64), state)
    objective_loss(out, counts, 0.8, False, world_size=2).backward()
    torch.save(_grads(draft), Path(out_dir) / f"rank{rank}-{compile}.pt")


def _worker(rank: int, port: int, out_dir: str, modes: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # In a function of its own, as the trainer's _run: the DDP wrapper (its reducer holds gloo
        # work) is gone before the group is destroyed. With it alive at destroy_process_group, a
        # rank now and then aborted at exit ("terminate called without an active exception").
        for compile in modes:  # one process group for both modes: a spawn costs ~5 s of imports
            _rank_gradients(rank, out_dir, compile)
            dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_ddp_gradient_equals_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    """Eager (``off``) and ``step``, where each rank runs the objective traced as one graph
    (``aot_eager``): its backward hands DDP every gradient at once. Either way the all-reduced
    result is the one process's."""
    import torch.multiprocessing as mp

    draft, features, ids, pos, loss_mask, docs = _inputs()
    out = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3)(features, ids, pos, loss_mask, docs)
    assert all(int(c) > 0 for c in out.counts)
    objective_loss(out, torch.stack(out.counts).double(), 0.8, False).backward()
    want = _grads(draft)

    modes = ["off", "step"]
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), modes), nprocs=2, join=True)
    for compile in modes:
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}-{compile}.pt")
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=f"{compile}: {name}")
