"""The learner's ranks on torch.distributed: who they are, what they exchange, and the gradient
rule that keeps N ranks one model.

A learner of N ranks is data parallel: every rank holds the whole model and optimizer; rank 0
alone consumes the admitted stream (it owns the consumer-group membership and the step's input
offsets) and hands each step's groups to the others (``Ranks.broadcast``); every rank trains on
its slice of them (``slice_of``) and the gradients are averaged across ranks before the one
optimizer step (``Ranks.reduce_grads``), so the replicas stay bit-identical. Publishing is
sharded (``producers.weights``: each rank encodes and writes its shard's chunks, rank 0 commits
the manifest with the offsets once every rank's chunks are acknowledged).

Rules (pure, unit-tested):

- ``slice_of``: of a step's ``n`` groups rank ``r`` of ``N`` trains the contiguous
  ``[n*r//N, n*(r+1)//N)``.
- ``combine_grads``: the gradient every rank steps with is ``sum_r t_r * g_r / sum_r t_r``,
  ``t_r`` the loss tokens of rank ``r``'s slice and ``g_r`` its gradient of its token-mean
  loss: the gradient of the token-mean loss over the whole step, as one rank would take it.
  It is summed in rank order from gradients gathered whole (``all_gather``, not a bucketed
  all-reduce whose summation order the library chooses), so the same inputs in the same order
  on the same number of ranks give bit-identical weights: ``rlstream replay`` of an N-rank run
  runs N ranks and checks every state hash. A parameter no rank has a gradient for keeps none
  (the optimizer skips it, as on one rank). A rank whose loss is not finite contributes NaN,
  so every rank refuses the step together (``grpo.NonFiniteStep``).

Backends: ``gloo`` on CPU (tested); ``nccl`` when the ranks have GPUs (the code path exists, it
is unverified: no GPU where this was written). Not FSDP2: every rank holds the whole model
(DDP-style replication with explicit gradient averaging).

Environment (set by ``rlstream run learner --ranks N``'s launcher, ``ops.ranks``, or by
``torchrun``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: Most seconds a rank waits in one collective (rank 0 sends a heartbeat while idle, so only a
#: step's training or publishing can take long).
COLLECTIVE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class RankEnv:
    """Where this process stands among the learner's ranks (from the environment)."""

    rank: int
    world: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankEnv | None:
        """The ranks the environment describes (``torchrun``'s variables), or None when it
        names none (``WORLD_SIZE`` unset)."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return None
        world, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is not in 0..{world - 1}")
        return cls(rank, world, env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]))


def slice_of(n: int, rank: int, world: int) -> tuple[int, int]:
    """``[lo, hi)`` of the ``n`` groups rank ``rank`` of ``world`` trains (module rules)."""
    return n * rank // world, n * (rank + 1) // world


def combine_grads(flats: Sequence[torch.Tensor], tokens: Sequence[float]) -> torch.Tensor:
    """The token-weighted average of the ranks' flat gradients, summed in rank order."""
    total = float(sum(tokens))
    weights = [t / total for t in tokens] if total > 0 else [1.0 / len(flats)] * len(flats)
    out = flats[0] * weights[0]
    for flat, w in zip(flats[1:], weights[1:], strict=True):
        out = out + flat * w
    return out


class Ranks:
    """This process's membership of the learner's process group (``producers.weights.Ranks``
    for the sharded publisher, plus what training needs)."""

    def __init__(self, env: RankEnv, backend: str | None = None) -> None:
        self.rank, self.world = env.rank, env.world
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # env:// so that under torchrun rank 0 joins the agent's store instead of opening one
        # on the same port (TORCHELASTIC_USE_AGENT_STORE); elsewhere the variables are ours.
        os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def reduce_grads(self, model: torch.nn.Module, loss: torch.Tensor, tokens: float) -> None:
        """Replace every parameter's gradient with ``combine_grads`` over the ranks (module
        rules); call after ``backward``, on every rank."""
        params = list(model.parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        if not torch.isfinite(loss):
            flat = torch.full_like(flat, float("nan"))
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        flats = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(flats, flat)
        meta = self.all_gather((float(tokens), has))
        combined = combine_grads(flats, [m[0] for m in meta])
        any_has = torch.stack([m[1] for m in meta]).amax(0)
        at = 0
        for p, keep in zip(params, any_has.tolist(), strict=True):
            n = p.numel()
            p.grad = combined[at : at + n].view_as(p).clone() if keep else None
            at += n

    def sync_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0's weights and optimizer state on every rank."""
        state = self.broadcast(
            (model.state_dict(), optimizer.state_dict()) if self.rank == 0 else None
        )
        if self.rank != 0:
            model.load_state_dict(state[0])
            optimizer.load_state_dict(state[1])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
