"""The learner's ranks without a broker: the slice and loss-weight rules, two real gloo processes
sharded by FSDP2 (rank 0's model and optimizer state adopted by both, the gathered gradient
equal to one process's token-weighted gradient), and the launcher (a failed rank stops the
others and fails the learner)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import rank_targets
import torch

from rlstream.ops.run.ranks import launch, rank_env, run_local_ranks
from rlstream.trainer.distributed import RankEnv, loss_weight, slice_of


def test_slices_cover_the_step_in_order() -> None:
    for n in (2, 3, 4, 7):
        for world in (1, 2, 3):
            if n < world:
                continue
            parts = [slice_of(n, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] and a[1] > a[0] for a, b in itertools.pairwise(parts))


def test_rank_env_reads_torchrun_variables() -> None:
    assert RankEnv.from_env({}) is None
    env = rank_env(1, 2, 29500)
    assert RankEnv.from_env(env) == RankEnv(1, 2, "127.0.0.1", 29500)
    with pytest.raises(ValueError):
        RankEnv.from_env({**env, "RANK": "2"})


def test_loss_weights_make_the_ranks_average_the_token_weighted_mean() -> None:
    assert [loss_weight([1.0, 3.0], r) for r in (0, 1)] == [0.5, 1.5]
    assert [loss_weight([0.0, 0.0], r) for r in (0, 1)] == [1.0, 1.0]
    # averaged over the ranks, the weighted gradients are sum t_r g_r / sum t_r
    g, t = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])], [1.0, 3.0]
    mean = sum(loss_weight(t, r) * g[r] for r in (0, 1)) / 2
    assert torch.equal(mean, (1.0 * g[0] + 3.0 * g[1]) / 4.0)


class _Net(torch.nn.Module):
    """Two used layers and one never used: it has no gradient on any rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = (
            torch.nn.Linear(4, 3),
            torch.nn.Linear(3, 1),
            torch.nn.Linear(2, 2),
        )

    def shard_units(self) -> list[torch.nn.Module]:
        return [self.a]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(rows))).square().mean()


DATA = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 40


#: One rank (started by ``launch`` with the torchrun variables): rank 0 takes one Adam step
#: alone, then both adopt rank 0's model and optimizer sharded, train their slices of DATA
#: with their loss weights, and save the gathered gradients, weights and optimizer state.
RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {here!r})
from test_learner_ranks import DATA, _Net
from rlstream.trainer.distributed import RankEnv, Ranks, gathered, gathered_optimizer
torch.use_deterministic_algorithms(True)
env = RankEnv.from_env()
ranks = Ranks(env, backend="gloo")
model = _Net()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
if env.rank == 0:  # state only rank 0 has: adopt hands it to every rank
    model(DATA[:2]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
adopted = gathered(model.state_dict()) if env.rank == 0 else None
optimizer = ranks.adopt(model, optimizer)
moments = gathered_optimizer(optimizer.state_dict())
rows = DATA[:3] if env.rank == 0 else DATA[3:]  # 3 and 7 "tokens"
factor, finite = ranks.weigh(float(len(rows)), True)
(model(rows) * factor).backward()
grads = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
weights = gathered(model.state_dict())
torch.save((grads, weights, moments, adopted, finite), os.path.join({out!r}, f"rank{{env.rank}}.pt"))
ranks.close()
"""


def test_two_sharded_gloo_ranks_take_the_one_process_gradient(tmp_path: Path) -> None:
    script = RANK_SCRIPT.format(here=str(Path(__file__).parent), out=str(tmp_path))
    assert launch([sys.executable, "-c", script], 2, log=lambda _: None) == 0
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    (g0, w0, m0, adopted, finite0), (g1, w1, m1, _, finite1) = got
    assert finite0 and finite1
    for name, value in adopted.items():  # rank 0's weights on both ranks, sharded and gathered
        assert torch.equal(w0[name], value) and torch.equal(w1[name], value), name
    assert m0["state"] and all(
        torch.equal(m0["state"][i][k], m1["state"][i][k])
        for i in m0["state"]
        for k in m0["state"][i]
    ), "the ranks' optimizer states differ"
    model = _Net()  # one process, the same start, the whole step
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(DATA[:2]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for i, state in optimizer.state_dict()["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(m0["state"][i][k], v)
    model(DATA).backward()
    for a, b, p in zip(g0, g1, model.parameters(), strict=True):
        if p.grad is None:
            assert a is None and b is None  # no rank had one: the optimizer skips it
            continue
        assert torch.equal(a, b), "the ranks' gathered gradients differ"
        torch.testing.assert_close(a, p.grad)


def test_a_failed_rank_stops_the_others_and_fails_the_learner(tmp_path: Path) -> None:
    script = (
        "import os, sys, time, pathlib\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "r = os.environ['RANK']\n"
        "(d / f'rank{r}').write_text(str(os.getpid()))\n"
        "if r == '1':\n"
        "    while not (d / 'rank0').exists(): time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    code = launch([sys.executable, "-c", script], 2, log=lambda _: None)
    assert code == 3
    pid0 = int((tmp_path / "rank0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)  # stopped and reaped by the launcher


def test_ranks_that_all_exit_cleanly_end_the_learner_cleanly() -> None:
    assert launch([sys.executable, "-c", "pass"], 3, log=lambda _: None) == 0


def test_local_ranks_fail_as_soon_as_one_rank_dies() -> None:
    import time

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit codes \[-9, 3\]"):
        run_local_ranks(rank_targets.rank_1_dies, 2, (), "test")
    assert time.monotonic() - started < 60
