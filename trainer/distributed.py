"""The learner's ranks on torch.distributed: who they are, what they exchange, and the rules
that keep N ranks one model.

A learner of N ranks is data parallel with its training state sharded by FSDP2. Rank 0 alone
consumes the admitted stream and hands each step's groups to the others; every rank trains on
its slice, and publishing is sharded too.

Rules (pure, unit-tested): ``slice_of`` gives each rank a contiguous slice; ``loss_weight``
scales each rank's loss so the averaged gradient is the whole step's token mean; a non-finite
loss on one rank makes every rank refuse the step together; the same inputs on the same number
of ranks give bit-identical weights; every rank produces gradients for the same parameters.

Backends: ``gloo`` on CPU (tested), ``nccl`` on GPUs (unverified). Environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
Details: docs/learner-ranks.md (Rules of the ranks).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

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


def loss_weight(tokens: Sequence[float], rank: int) -> float:
    """Rank ``rank``'s loss factor ``N * t_r / sum_r t_r`` (module rules); 1 when no rank has a
    loss token."""
    total = float(sum(tokens))
    return len(tokens) * float(tokens[rank]) / total if total > 0 else 1.0


def gathered(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """``state`` with every sharded tensor (``DTensor``) gathered whole; a collective when any
    is sharded: every rank calls it with the same keys in the same order."""
    out = dict(state)
    out.update(_gather_rows({k: v for k, v in state.items() if isinstance(v, DTensor)}))
    return out


def gathered_optimizer(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with its sharded tensors gathered whole: the state dict an
    unsharded optimizer over the same parameters would have."""
    flat = {(i, k): v for i, s in state["state"].items() for k, v in s.items()}
    whole = gathered(flat)
    per_param: dict[Any, dict[str, Any]] = {}
    for (i, k), v in whole.items():
        per_param.setdefault(i, {})[k] = v
    return {"state": dict(sorted(per_param.items())), "param_groups": state["param_groups"]}


def _gather_rows(tensors: Mapping[Any, DTensor]) -> dict[Any, torch.Tensor]:
    """Whole tensors of FSDP2 shards in one all-gather per dtype instead of one per tensor.

    FSDP2 cuts a tensor of ``n`` rows over ``N`` ranks as ``torch.chunk`` does: rank ``r`` holds
    rows ``[r*c, min(n, (r+1)*c))`` with ``c = ceil(n / N)``. Each rank pads its rows to ``c``,
    the padded shards of all tensors are gathered as one flat buffer, and every tensor is cut
    back out of the ranks' parts. A tensor placed otherwise is gathered on its own."""
    out: dict[Any, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[Any]] = {}
    for key, t in tensors.items():
        if t.device_mesh.ndim == 1 and t.placements == (Shard(0),) and t.dim() > 0:
            by_dtype.setdefault(t.dtype, []).append(key)
        else:
            out[key] = t.full_tensor()
    for keys in by_dtype.values():
        group = tensors[keys[0]].device_mesh.get_group()
        world = dist.get_world_size(group)
        rows = [-(-tensors[k].shape[0] // world) for k in keys]
        pads = []
        for k, c in zip(keys, rows, strict=True):
            local = tensors[k].to_local()
            pad = local.new_zeros((c, *tensors[k].shape[1:]))
            pad[: local.shape[0]] = local
            pads.append(pad.reshape(-1))
        mine = torch.cat(pads)
        every = mine.new_empty(world * mine.numel())
        dist.all_gather_into_tensor(every, mine, group=group)
        parts = every.view(world, -1)
        at = 0
        for k, c in zip(keys, rows, strict=True):
            shape = tensors[k].shape
            size = c * shape[1:].numel()
            block = parts[:, at : at + size].reshape(world * c, *shape[1:])
            out[k] = block[: shape[0]].clone()
            at += size
    return out


def _sharded_like(value: Any, param: torch.Tensor) -> Any:
    """``value`` (a whole tensor, the same on every rank) cut as ``param`` is sharded, without
    communication; anything else unchanged."""
    whole = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)
    if isinstance(param, DTensor) and whole:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


CLOSE_TIMEOUT_S = 30.0


class Ranks:
    """This process's membership of the learner's process group (``producers.weights.shards.PublishingRanks``
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

    def adopt(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """Rank 0's weights and optimizer state on every rank, the model sharded with FSDP2 in
        place (each module of ``model.shard_units()``, where it has one, then the root), and
        returns an optimizer of the same kind and settings over the shards, holding that state.
        Call once, on every rank, before training; the optimizer passed in is spent."""
        state = self.broadcast(
            (model.state_dict(), optimizer.state_dict()) if self.rank == 0 else None
        )
        if self.rank != 0:
            model.load_state_dict(state[0])
        for unit in getattr(model, "shard_units", list)():
            fully_shard(unit)
        fully_shard(model)
        sharded = type(optimizer)(model.parameters(), **optimizer.defaults)
        params = list(model.parameters())
        full = state[1]
        sharded.load_state_dict(
            {
                "param_groups": full["param_groups"],
                "state": {
                    i: {k: _sharded_like(v, params[i]) for k, v in s.items()}
                    for i, s in full["state"].items()
                },
            }
        )
        return sharded

    def weigh(self, tokens: float, finite: bool) -> tuple[float, bool]:
        """This rank's loss factor (``loss_weight`` over every rank's loss tokens) and whether
        every rank's loss is finite; every rank calls it once per step, before backward."""
        rows = self.all_gather((float(tokens), bool(finite)))
        return loss_weight([t for t, _ in rows], self.rank), all(f for _, f in rows)

    def close(self) -> None:
        """Leave together, then tear down: a rank that destroyed its group while its peer still
        held the connection aborted the peer in gloo ("terminate called without an active
        exception", 1 of the unit tier's runs on 2 busy cores). A peer that is gone is not
        waited for longer than ``CLOSE_TIMEOUT_S``."""
        if not dist.is_initialized():
            return
        if self.world > 1 and dist.get_backend() == "gloo":
            with contextlib.suppress(RuntimeError):  # a peer that died: nothing to wait for
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=CLOSE_TIMEOUT_S))
        dist.destroy_process_group()
