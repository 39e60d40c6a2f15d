"""The learner's ranks without a broker: the slice and gradient rules, the gradient average over
two real gloo processes (replicas bit-identical, equal to one process's token-weighted
gradient), and the launcher (a failed rank stops the others and fails the learner)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

from rlstream.ops.ranks import launch, rank_env
from rlstream.trainer.distributed import RankEnv, combine_grads, slice_of


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


def test_combined_gradient_is_the_token_weighted_mean() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    assert torch.equal(combine_grads([a, b], [1.0, 3.0]), torch.tensor([2.5, 5.0]))
    assert torch.equal(combine_grads([a, b], [0.0, 0.0]), torch.tensor([2.0, 4.0]))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1), torch.nn.Linear(2, 2))


DATA = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 40


def _loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    # the last layer is never used: it has no gradient on any rank
    return model[1](torch.tanh(model[0](rows))).square().mean()


#: One rank (started by ``launch`` with the torchrun variables): its slice of DATA, backward,
#: the gradient average, and its gradients saved for the test to compare.
RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {here!r})
from test_learner_ranks import DATA, _loss, _model
from rlstream.trainer.distributed import RankEnv, Ranks
torch.use_deterministic_algorithms(True)
env = RankEnv.from_env()
ranks = Ranks(env, backend="gloo")
model = _model()
rows = DATA[:3] if env.rank == 0 else DATA[3:]  # 3 and 7 "tokens"
loss = _loss(model, rows)
loss.backward()
ranks.reduce_grads(model, loss.detach(), float(len(rows)))
grads = [None if p.grad is None else p.grad for p in model.parameters()]
torch.save(grads, os.path.join({out!r}, f"grads{{env.rank}}.pt"))
ranks.close()
"""


def test_two_gloo_ranks_average_gradients_into_identical_replicas(tmp_path: Path) -> None:
    script = RANK_SCRIPT.format(here=str(Path(__file__).parent), out=str(tmp_path))
    assert launch([sys.executable, "-c", script], 2, log=lambda _: None) == 0
    got = [torch.load(tmp_path / f"grads{r}.pt") for r in range(2)]
    model = _model()
    _loss(model, DATA).backward()  # one process, the whole step
    for g0, g1, p in zip(got[0], got[1], model.parameters(), strict=True):
        if p.grad is None:
            assert g0 is None and g1 is None  # no rank had one: the optimizer skips it
            continue
        assert torch.equal(g0, g1), "the replicas' gradients differ"
        torch.testing.assert_close(g0, p.grad)


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
