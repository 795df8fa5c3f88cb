"""The defaults the documentation states are the code's: the configuration tables (README, the embedded model, the
in-process model, streaming) against ``Settings()``, every settings key named in the README's reference, and the
baselines' parameter table against each method's ``Params``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tmas.config import ENV_KEYS, SERVICE_ROLES, Settings, load_settings
from tmas.methods import METHODS, create_method, method_traits

ROOT = Path(__file__).resolve().parent.parent
NOT_A_VALUE = object()
# Defaults the tables state in words (worked out at run time, or read from the server).
DESCRIBED = {
    "endpoint.base_url",
    "endpoint.model",
    "endpoint.context_length",
    "endpoint.pin_slots",
    "sampling.*",
    "roles.ROLE.*",
    "problems_in_flight",
    "method.name",
}


def table_rows(doc: str) -> list[tuple[list[str], str]]:
    """``(keys, default)`` of each row of the ``| key | default | meaning |`` tables in ``doc``."""
    rows = []
    in_table = False
    for line in (ROOT / doc).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[:2] == ["key", "default"]:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
        if in_table and len(cells) >= 3 and not set(cells[0]) <= {"-", " "}:
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def parse_value(text: str) -> Any:
    """A default as a table writes it: `none`, a number, `true`/`false`, a backticked or quoted word; else
    :data:`NOT_A_VALUE` (a default stated in words)."""
    text = text.strip().strip("`").strip('"')
    if text == "none":
        return None
    if text in ("true", "false"):
        return text == "true"
    if text == "[]":
        return []
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", text):
        number = float(text.replace(",", ""))
        return int(number) if number.is_integer() else number
    if re.fullmatch(r"[a-z_.0-9-]+", text):
        return text
    return NOT_A_VALUE


def setting(settings: Settings, key: str) -> Any:
    value: Any = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


def checked_defaults(doc: str, prefix: str = "") -> list[str]:
    """Check every row of ``doc``'s settings tables whose default is a value; the keys checked."""
    settings = Settings()
    checked = []
    for keys, default in table_rows(doc):
        keys = [k if "." in k or not prefix else prefix + k for k in keys]
        if any(k in DESCRIBED for k in keys):
            continue
        values = [parse_value(v) for v in default.split(", ")] if len(keys) > 1 else [parse_value(default)]
        if len(values) == 1:  # one default for every key of the row
            values *= len(keys)
        assert len(values) == len(keys), f"{doc}: {keys} states {default!r}"
        for key, value in zip(keys, values, strict=True):
            assert value is not NOT_A_VALUE, f"{doc}: {key}'s default {default!r} is neither a value nor described"
            actual = setting(settings, key)
            if value is None and actual == []:
                actual = None
            assert actual == value, f"{doc}: {key} is documented as {default!r}, the code's default is {actual!r}"
            checked.append(key)
    return checked


@pytest.mark.parametrize(
    ("doc", "prefix", "fewest"),
    [
        ("README.md", "", 25),
        ("docs/local_model.md", "", 9),
        ("docs/in_process.md", "", 9),
        ("docs/sampling_and_budgets.md", "endpoint.", 5),
    ],
)
def test_documented_setting_defaults_are_the_codes(doc: str, prefix: str, fewest: int) -> None:
    assert len(checked_defaults(doc, prefix)) >= fewest


def leaf_keys(model: Any, prefix: str = "") -> list[str]:
    keys = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if hasattr(type(value), "model_fields"):
            keys += leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def test_the_readme_reference_names_every_setting() -> None:
    documented = {k for keys, _ in table_rows("README.md") for k in keys}
    # Tables of their own: sampling's fields, the in-process model's, and the method's parameters.
    elsewhere = ("sampling.", "hf.", "method.")
    internal = {"sampling_sources"}  # which source set each sampling field, recorded by the loader
    missing = [
        k
        for k in leaf_keys(Settings())
        if k not in documented and k not in internal and not k.startswith(elsewhere) and k != "roles"
    ]
    assert not missing, f"README.md's configuration reference leaves out {missing}"


def test_the_readme_reference_names_each_variable_in_its_settings_row() -> None:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    for var, key in ENV_KEYS.items():
        row_key = "sampling.*" if key.startswith("sampling.") else key
        row = next((line for line in rows if f"`{row_key}`" in line.split("|")[1]), None)
        assert row is not None, f"README.md's configuration reference has no row for {key}"
        assert f"`{var}`" in row, f"README.md's row for {key} does not name its variable {var}"


def baseline_rows() -> list[tuple[str, str]]:
    rows = []
    for line in (ROOT / "docs" / "baselines.md").read_text().splitlines():
        module = re.match(r"\|[^|]+\| `(\w+)\.py` \|[^|]+\|(.+)\|$", line)
        if module:
            rows.append((module.group(1), module.group(2)))
    return rows


def test_the_baselines_table_states_each_methods_defaults() -> None:
    rows = baseline_rows()
    assert {name for name, _ in rows} == {"cot", "majority", "self_refine", "verify_refine", "pacore", "rse"}
    stated = 0
    for method, cell in rows:
        params = create_method(method, {}).params
        for name, raw in re.findall(r"`(\w+)=([\w.]+)`", cell):
            value = parse_value(raw)
            assert getattr(params, name) == value, (
                f"baselines.md: {method}'s {name}={raw}, code: {getattr(params, name)}"
            )
            stated += 1
    assert stated >= 25


def test_the_readme_lists_every_extra() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"dev"}
    listed = set(re.findall(r"^\| `([\w-]+)` \| ", (ROOT / "README.md").read_text(), re.M))
    assert extras <= listed, f"README.md's table of extras leaves out {sorted(extras - listed)}"


def test_every_method_but_mattrl_takes_style() -> None:
    # The README's method table and docs/baselines.md say so.
    takes = {name for name in METHODS if "style" in type(create_method(name, {}).params).model_fields}
    assert set(METHODS) - takes == {"mattrl"}


# The pages on configuration: their ```toml blocks are settings files (others show grid files and package metadata
# too), and their `tmas` lines commands (tests/test_doc_commands.py).
CONFIG_PAGES = [
    "README.md",
    "docs/servers.md",
    "docs/sampling_and_budgets.md",
    "docs/in_process.md",
    "docs/local_model.md",
    "docs/baselines.md",
    "docs/viewer.md",
    "docs/architecture.md",
]


# Every page with a ```toml block: those blocks are settings files (grid files are shown under other fences).
SETTINGS_PAGES = sorted(
    str(p.relative_to(ROOT))
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    if "```toml\n" in p.read_text()
)


def test_every_config_page_with_a_settings_file_has_it_checked() -> None:
    # A page's settings files are checked wherever they are; the pages on configuration that show some are among them.
    assert {"README.md", "docs/local_model.md", "docs/sampling_and_budgets.md"} <= set(SETTINGS_PAGES)


@pytest.mark.parametrize("doc", SETTINGS_PAGES)
def test_the_config_files_the_docs_show_load(doc: str, tmp_path: Path) -> None:
    for block in re.findall(r"```toml\n(.*?)```", (ROOT / doc).read_text(), re.S):
        path = tmp_path / "tmas.toml"
        path.write_text(block)
        load_settings(path, environ={})


def test_the_readme_names_every_role_a_roles_table_may_name() -> None:
    paragraph = (ROOT / "README.md").read_text().split("Each agent role (")[1].split(")")[0]
    named = set(re.findall(r"`(\w+)`", paragraph))
    roles = set(SERVICE_ROLES).union(*(method_traits(name).roles for name in METHODS))
    assert named == roles


def parameter_tables(doc: str) -> list[tuple[list[str], str, str]]:
    """``(methods, parameter, default)`` of each row of the ``| parameter (METHODS) | default | what |`` tables."""
    rows, methods = [], []
    for line in (ROOT / doc).read_text().splitlines():
        header = re.match(r"\| parameter \(([\w, ]+)\) \| default \|", line)
        if header:
            methods = [m.strip() for m in header.group(1).split(",")]
            continue
        row = re.match(r"\| `(\w+)` \| ([^|]+) \|", line) if methods else None
        if row:
            rows.append((methods, row.group(1), row.group(2).strip()))
        elif not line.startswith("|"):
            methods = []
    return rows


def test_the_stopping_and_confidence_tables_state_the_codes_defaults() -> None:
    rows = parameter_tables("docs/sampling_and_budgets.md")
    stated = 0
    for methods, name, default in rows:
        value = parse_value(default)
        if value is NOT_A_VALUE:  # a default per method, in words
            continue
        for method in methods:
            actual = getattr(create_method(method, {}).params, name)
            assert actual == value, f"sampling_and_budgets.md: {method}'s {name} is {default}, code: {actual}"
            stated += 1
    assert stated >= 10


def test_the_embedded_model_shrinks_each_baseline_as_documented() -> None:
    # docs/baselines.md: "like TMAS's local preset (N = 2, T = 2; majority k = 4)".
    for name, width in (("self_refine", "n"), ("verify_refine", "n"), ("rse", "n"), ("pacore", "responses_per_round")):
        params = create_method(name, {}, embedded=True).params
        assert (getattr(params, width), params.iterations) == (2, 2), name
    assert create_method("majority", {}, embedded=True).params.k == 4


def test_the_mattrl_parameter_table_states_the_codes_defaults() -> None:
    section = (ROOT / "docs" / "mattrl.md").read_text().split("## Parameters")[1].split("\n## ")[0]
    params = create_method("mattrl", {}).params
    stated = {}
    for line in section.splitlines():
        row = re.match(r"\| `(\w+)` \| ([^|]+) \|", line)
        if row:
            stated[row.group(1)] = parse_value(row.group(2))
    # Every parameter of MATTRL's own (mode, numeric or proof answers, is a field every method has).
    assert set(stated) == set(type(params).model_fields) - {"mode"}
    for name, value in stated.items():
        assert getattr(params, name) == value, f"mattrl.md: {name} is {value!r}, code: {getattr(params, name)!r}"
