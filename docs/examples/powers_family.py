"""An example task-family plugin: generated problems, scored like a dataset's own.

``powers`` asks for ``def power_K(x)`` returning ``x ** K`` for K in 2..``max_power``, with
hidden tests made from the same K. It subclasses the ``dataset`` family and overrides only
``load_problems``, so sampling, the held-out split, the policy's tools and the sandboxed,
unforgeable verdict are the dataset family's. Register it from your package's
``pyproject.toml``::

    [project.entry-points."rlstream.task_families"]
    powers = "powers_family:PowersFamily"

and name it in a recipe::

    [families.pow]
    plugin = "powers"
    options = { max_power = 9 }

``tests/unit/test_example_plugin.py`` registers this file that way and runs it.
"""

from pydantic import Field

from rlstream.envs.dataset import DatasetConfig, DatasetFamily, Problem


class PowersConfig(DatasetConfig):
    """The dataset family's options (limits, tools, held-out share), and how many powers."""

    max_power: int = Field(6, ge=2, le=64, description="The largest exponent asked for.")


class PowersFamily(DatasetFamily):
    plugin = "powers"
    Config = PowersConfig
    cfg: PowersConfig

    def load_problems(self, cfg: DatasetConfig) -> dict[str, Problem]:
        assert isinstance(cfg, PowersConfig)
        problems = {}
        for k in range(2, cfg.max_power + 1):
            checks = "".join(f"    assert candidate({x}) == {x**k}\n" for x in (-3, 0, 2, 5))
            problems[f"pow{k}"] = Problem(
                task_id=f"pow{k}",
                prompt=f'def power_{k}(x):\n    """Return x to the power {k}."""\n',
                entry_point=f"power_{k}",
                test=f"def check(candidate):\n{checks}",
                canonical_solution=f"    return x ** {k}\n",
                split="eval" if k % 4 == 0 else "train",  # pow4, pow8, ... held out
            )
        return problems
