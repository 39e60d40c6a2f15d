"""The documented example plugin (docs/examples/powers_family.py), registered the way a user's
package registers one (an entry point in its installed metadata), scored through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.envs import family as task_families
from rlstream.ops.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example as an installed distribution: its metadata and entry point on sys.path."""
    meta = tmp_path / "powers_example-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: powers-example\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(
        "[rlstream.task_families]\npowers = powers_family:PowersFamily\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return tmp_path


def test_the_example_plugin_registers_samples_and_scores(installed: Path, capsys) -> None:
    assert main(["env", "families", "--json"]) == 0
    assert "powers" in capsys.readouterr().out
    spec = task_families.FamilySpec(plugin="powers", options={"max_power": 9})
    fam = task_families.families({"pow": spec})["pow"]
    task = fam.sample(3)
    assert task.task_id.startswith("pow-3:pow") and "def power_" in task.prompt
    held_out = {t.task_id.split(":")[1] for t in fam.eval_tasks(10)}
    assert held_out == {"pow4", "pow8"}
    recipe = installed / "run.toml"
    recipe.write_text('[families.pow]\nplugin = "powers"\noptions = { max_power = 9 }\n')
    assert main(["env", "score", "--family", "pow", "--recipe", str(recipe), "--canonical"]) == 0
    assert "8 tasks, 8 passed, 0 errors, 0 broken" in capsys.readouterr().out
    answers = installed / "answers.jsonl"
    answers.write_text(
        json.dumps({"task_id": "pow-3:pow3", "completion": "    return x * x * x\n"})
        + "\n"
        + json.dumps({"task_id": "pow-3:pow3", "completion": "    return x * 3\n"})
        + "\n"
    )
    code = main(["env", "score", "--family", "pow", "--recipe", str(recipe), "--answers",
                 str(answers), "--json"])  # fmt: skip
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 0 and [line.get("passed") for line in out[:2]] == [True, False]
