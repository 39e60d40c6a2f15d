"""What ``rlstream launch`` starts for a recipe, and how it writes the same processes down."""

from __future__ import annotations

import json
import shlex

import pytest

from rlstream.ops.cli import main
from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.launch import (
    CONTAINER_KEY,
    compose_file,
    plan,
    shared_args,
    systemd_units,
)
from rlstream.ops.run.regions import RegionCluster
from rlstream.producers.weights.run_keys import RunKeys
from rlstream.schemas.derive import shared

KEYS = RunKeys("ab" * 32, "/keys/run.pem")


def test_the_plan_follows_the_recipe() -> None:
    config = load_run_config(None, ['regions.rollout=["eu", "us"]', "launch.rollout_workers=3"])
    names = [p.name for p in plan(config)]
    assert names == [
        "learner", "admission", "judge-tests", "judge-format", "rollout-eu-0", "rollout-us-1",
        "rollout-eu-2", "scheduler", "eval", "tracker",
    ]  # fmt: skip
    regions = {p.name: p.region for p in plan(config)}
    assert regions["rollout-us-1"] == "us" and regions["learner"] == "trainer"
    lean = load_run_config(None, ["launch.eval=false", "launch.tracker=false"])
    assert [p.name for p in plan(lean, rollout_workers=1, feedback=True)][-3:] == [
        "rollout-trainer-0", "feedback-rl", "scheduler",
    ]  # fmt: skip
    two = load_run_config(None, ["launch.judge_members=2"])
    judges = [p for p in plan(two) if p.role == "judge"]
    assert [(p.name, p.args) for p in judges][:2] == [
        ("judge-tests-0", ("--name", "tests", "--member", "0")),
        ("judge-tests-1", ("--name", "tests", "--member", "1")),
    ]


def test_lent_workers_get_a_capacity_role_and_slots_in_each_region() -> None:
    config = load_run_config(None, ['regions.rollout=["eu", "us"]', "launch.lent_workers=2"])
    tidal = [(p.name, p.region, p.args) for p in plan(config, rollout_workers=1)]
    lent = ("--set", "rollout.lent=true")
    assert tidal[4:11] == [
        ("rollout-eu-0", "eu", ("--member", "0")),
        ("capacity-eu", "eu", ()),
        ("rollout-eu-lent-0", "eu", ("--member", "0", *lent)),
        ("rollout-eu-lent-1", "eu", ("--member", "1", *lent)),
        ("capacity-us", "us", ()),
        ("rollout-us-lent-0", "us", ("--member", "0", *lent)),
        ("rollout-us-lent-1", "us", ("--member", "1", *lent)),
    ]
    # set per process: not part of what the run records and every role checks
    assert shared(load_run_config(None, ["rollout.lent=true"])) == shared(load_run_config(None, []))


def test_every_process_gets_the_same_recipe_and_sets() -> None:
    config = load_run_config(None, [])
    shared = shared_args("ops/recipes/demo.toml", ["seed=3"])
    for p in plan(config):
        cmd = p.command("r1", shared, "/state")
        assert cmd[:4] == ["rlstream", "run", p.role, "--run"]
        assert cmd[-4:] == ["--config", shared[1], "--set", "seed=3"]
        assert "--bootstrap" not in cmd  # the recipe or the local cluster, never an address


def test_units_and_compose_give_the_signing_key_to_the_learner_alone() -> None:
    config = load_run_config(None, [])
    procs, shared = plan(config), shared_args(None, ["seed=3"])
    units = systemd_units("r1", procs, shared, KEYS, "/state")
    assert len(units) == len(procs)
    for name, text in units.items():
        learner = name == "rlstream-r1-learner.service"
        assert ("RLSTREAM_WEIGHTS_SIGNING_KEY=" in text) == learner
        assert "RLSTREAM_WEIGHTS_VERIFY_KEY=" + "ab" * 32 in text
        assert "RestartPreventExitStatus=2" in text
        exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        assert shlex.split(exec_line.removeprefix("ExecStart="))[-1] == "--once"
    compose = json.loads(compose_file("r1", procs, shared, KEYS, "img:1"))
    envs = {n: s["environment"] for n, s in compose["services"].items()}
    assert [n for n, e in envs.items() if "RLSTREAM_WEIGHTS_SIGNING_KEY" in e] == ["learner"]
    learner = compose["services"]["learner"]  # the host's key file, mounted for it alone
    assert learner["volumes"] == ["/keys/run.pem:/run/secrets/rlstream-weights-signing-key.pem:ro"]
    assert envs["learner"]["RLSTREAM_WEIGHTS_SIGNING_KEY"] == CONTAINER_KEY
    assert [n for n, s in compose["services"].items() if "volumes" in s] == ["learner"]
    assert compose["services"]["scheduler"]["command"][:2] == ["run", "scheduler"]


def test_a_cluster_entry_gives_each_role_its_own_principal(monkeypatch: pytest.MonkeyPatch):
    entry = RegionCluster(
        bootstrap="kafka:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="rl-{role}",
        sasl_password_env="RL_{ROLE}_PASSWORD",
    )
    monkeypatch.setenv("RL_FEEDBACK_RL_PASSWORD", "p1")
    settings = entry.settings("feedback-rl")
    assert settings.sasl_username == "rl-feedback-rl"
    assert settings.sasl_password is not None
    assert settings.sasl_password.get_secret_value() == "p1"
    with pytest.raises(SystemExit, match=r"\$RL_LEARNER_PASSWORD \(SASL password of learner\)"):
        entry.settings("learner")


def test_dry_run_prints_the_processes_and_starts_nothing(capsys) -> None:
    assert main(["launch", "demo", "--dry-run", "--run", "r1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# run r1, config ") and lines[0].endswith(": 9 processes")
    assert all(shlex.split(line)[:2] == ["rlstream", "run"] for line in lines[1:])
