"""Every grid file under examples/ loads through the sweep loader and every point's method accepts its parameters, so
a misspelt key or a parameter a method no longer has fails here rather than in a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmas.errors import ConfigError
from tmas.methods import create_method
from tmas.sweep import expand, load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GRIDS = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.toml"))


def test_the_examples_have_grids() -> None:
    assert "sweep_equal_budget.toml" in GRIDS and "sweep_tmas_sensitivity.toml" in GRIDS


@pytest.mark.parametrize("name", GRIDS)
def test_example_grid_loads_and_its_methods_take_its_params(name: str) -> None:
    points = expand(load_spec(EXAMPLES / name))
    assert points
    for point in points:
        create_method(point.method, point.params)


def test_an_unknown_key_in_a_grid_is_refused(tmp_path: Path) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text((EXAMPLES / "sweep_equal_budget.toml").read_text() + "\nbudgett = 3\n")
    with pytest.raises(ConfigError, match="budgett"):
        load_spec(grid)


def test_an_unknown_method_parameter_in_a_grid_is_refused(tmp_path: Path) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('[[study]]\nname = "s"\nmethod = "tmas"\nparams = { nn = 4 }\n')
    with pytest.raises(ConfigError, match="unknown parameter 'nn'"):
        for point in expand(load_spec(grid)):
            create_method(point.method, point.params)
