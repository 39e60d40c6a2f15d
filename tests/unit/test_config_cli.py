"""``rlstream config``: recipes checked with one line per problem, resolved values with where they
came from, the reference page generated from the models, and the run's config hash over the
values every role must agree on."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest

from rlstream.ops.cli import main
from rlstream.ops.run import recorded
from rlstream.ops.run.config import RECIPES, load_run_config
from rlstream.ops.run.config_docs import reference
from rlstream.schemas.derive import shared
from rlstream.schemas.errors import CONFIG_EXIT

ROOT = Path(__file__).resolve().parents[2]

#: Bad recipes, each with the one line `config validate` must print for it.
BAD = {
    "typo.toml": ("[learner]\nlrr = 0.1\n", "learner.lrr: not a setting here"),
    "range.toml": ("group_size = 1\n", "group_size: Input should be greater than or equal to 2"),
    "type.toml": ('[learner]\nlr = "fast"\n', "learner.lr: Input should be a valid number"),
    "kind.toml": ('[learner.loss]\nkind = "zz"\n', "learner.loss: Input tag 'zz' found using"),
    "toml.toml": ("x = [\n", "not TOML"),
    "judges.toml": (
        "[admission.judges]\nstyle = 1.0\n",
        "admission.judges names style, which [judges] does not define",
    ),
    "section.toml": ("learner = 3\n", "learner: Input should be a valid dictionary"),
}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``rlstream config ARGS`` in this process (its exit status and output)."""
    capsys.readouterr()
    code = main(["config", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_recipe_is_one_line_and_exit_status_2(tmp_path: Path, name: str, capsys) -> None:
    text, expected = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    out = _cli(capsys, "validate", str(path))
    assert out.returncode == CONFIG_EXIT, out
    assert "Traceback" not in out.stderr
    problems = [line for line in out.stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and expected in problems[0], out.stderr


def test_every_shipped_recipe_is_valid_or_names_its_missing_model(capsys) -> None:
    for recipe in sorted(RECIPES.glob("*.toml")):
        out = _cli(capsys, "validate", recipe.stem)
        model = tomllib.loads(recipe.read_text()).get("policy", {}).get("hf_dir")
        if model and not Path(model).expanduser().is_dir():  # `make smollm2` not run here
            assert out.returncode == CONFIG_EXIT and "policy.hf_dir: " in out.stderr
            continue
        assert out.returncode == 0, out.stderr
        assert "valid; config" in out.stdout


def test_show_says_where_each_value_came_from(capsys) -> None:
    out = _cli(capsys, "show", "repo", "--set", "seed=7", "--set", "learner.state_dir=/s", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["key"]: r for r in json.loads(out.stdout)["keys"]}
    assert rows["seed"] == {"key": "seed", "value": 7, "source": "--set", "local": False}
    assert rows["learner.state_dir"] == {
        "key": "learner.state_dir",
        "value": "/s",
        "source": "--set",
        "local": True,
    }
    assert rows["families.repo.plugin"]["source"] == "recipe"
    assert rows["learner.lr"]["source"] in ("recipe", "default")
    assert rows["sync_oversample"]["source"] == "default"


def test_the_reference_page_is_current() -> None:
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == reference(), "run `rlstream config docs --out docs/config-reference.md`"


def test_a_loss_table_without_its_kind_tunes_the_default_objective() -> None:
    config = load_run_config(None, ["learner.loss.entropy_coef=0.01"])
    assert config.learner.loss.kind == "tis" and config.learner.loss.entropy_coef == 0.01


def test_the_hash_covers_shared_values_and_not_local_ones() -> None:
    base = load_run_config(None, [])
    assert recorded.config_hash(base) == recorded.config_hash(load_run_config(None, []))
    local = load_run_config(None, ["learner.state_dir=/elsewhere", "rollout.torch_threads=4"])
    assert recorded.config_hash(local) == recorded.config_hash(base)
    other = load_run_config(None, ["learner.lr=0.5"])
    assert recorded.config_hash(other) != recorded.config_hash(base)
    assert "state_dir" not in json.dumps(shared(base))


def test_differences_name_each_key_and_both_values() -> None:
    a = shared(load_run_config(None, []))
    b = shared(load_run_config(None, ["learner.lr=0.5", "group_size=4"]))
    lines = recorded.differences(a, b)
    assert any(line.startswith("learner.lr: recorded ") and "here 0.5" in line for line in lines)
    assert any(line.startswith("group_size: recorded 8, here 4") for line in lines)
    assert all(not line.startswith("learner.state_dir") for line in lines)


def test_every_recipe_recorded_reads_back_to_the_same_hash() -> None:
    """What a run records (its config as JSON) validates again to the same config: replay and
    the roles' check read it back (a judge-less default in admission once made it refuse)."""
    for recipe in sorted(RECIPES.glob("*.toml")):
        model = tomllib.loads(recipe.read_text()).get("policy", {}).get("hf_dir")
        if model and not Path(model).expanduser().is_dir():
            continue
        config = load_run_config(str(recipe), [])
        view = recorded.recorded_view(config.model_dump_json())
        assert view is not None and recorded.config_hash(view) == recorded.config_hash(config)
    assert recorded.recorded_view("{}") is None
