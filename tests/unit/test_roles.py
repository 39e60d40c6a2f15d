"""Each role is declared once (``ops.run.roles.ROLES``) and everything else follows from it: the
``rlstream run`` subcommands, the dispatch to the role's module, the config chain of the run
recipe, the principals and their ACLs, the users of ``rlstream serve``."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from rlstream.ops.cli import cmd_run, cmd_serve
from rlstream.ops.run import acls
from rlstream.ops.run.config import RunConfig, load_run_config
from rlstream.ops.run.roles import ROLES, RUN_ROLES, SERVICES


def test_every_declared_module_exists_and_every_role_has_an_entry_point() -> None:
    for role in ROLES.values():
        assert importlib.util.find_spec(role.module) is not None, role
    for name in RUN_ROLES:
        spec = importlib.util.find_spec(ROLES[name].module)
        assert spec is not None and spec.origin is not None
        assert "def run_role(" in Path(spec.origin).read_text(), name


def test_the_command_line_starts_exactly_the_declared_roles() -> None:
    parser = argparse.ArgumentParser()
    cmd_run.register(parser.add_subparsers())
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    roles = next(
        a for a in run.choices["run"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    assert tuple(roles.choices) == ("tap", *RUN_ROLES)
    assert set(RUN_ROLES) | set(SERVICES.values()) == set(ROLES)


def test_the_principals_and_the_services_are_the_declared_ones() -> None:
    assert tuple(ROLES) == acls.PRINCIPALS
    assert {name: a for name, a in acls.ACCESS.items()} == {n: r.access for n, r in ROLES.items()}
    assert set(acls.SERVICES) == {
        cmd_serve.FEEDBACK_USER,
        cmd_serve.POLICY_USER,
        cmd_serve.VLLM_USER,
    }
    assert SERVICES == {
        "feedback": "feedback-ingest",
        "policy": "policy-server",
        "vllm": "vllm-follower",
    }


@pytest.mark.parametrize("name", RUN_ROLES)
def test_every_role_gets_its_section_with_the_shared_values(name: str) -> None:
    role = ROLES[name]
    assert role.section in RunConfig.model_fields, role
    run = load_run_config(None, ["seed=7", "model=m1"])
    cfg = run.role(name, role.example or None)
    section = getattr(run, role.section or "")
    own = section[role.example] if role.named else section
    assert type(cfg) is type(own)
    for field in ("seed", "model"):
        if field in type(cfg).model_fields:
            assert getattr(cfg, field) == getattr(run, field), (name, field)


def test_an_unknown_role_and_a_service_have_no_run_config() -> None:
    run = load_run_config()
    for name in ("nobody", "feedback-ingest"):
        with pytest.raises(SystemExit, match="unknown role"):
            run.role(name)
