"""Sampling resolved once (tmas.llm.sampling): the priority table field by field and source by source, which
source set each field, a user's value equal to a preset's or the built-in one, settings without recorded sources
(stored before them), and the sources recorded with every call in the run store."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from tmas.api import asolve
from tmas.config import Sampling, Settings, load_settings, with_overrides
from tmas.llm.sampling import (
    DERIVED_SEED,
    RETRY_SEED,
    SAMPLE_SEEDS,
    SOURCES,
    derived_base,
    earlier_configured_seeds,
    for_sample,
    resolve_role,
    resolve_sampling,
    retried,
    with_sampling,
)
from tmas.methods.tmas_params import TMASParams
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript

# One distinct value per source for every field: the value sent says which source won.
VALUES: dict[str, list[Any]] = {
    "temperature": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9],
    "top_p": [0.11, 0.22, 0.33, 0.44, 0.55, 0.66, 0.77, 0.88],
    "max_tokens": [11, 22, 33, 44, 55, 66, 77, 88],
    "seed": [1, 2, 3, 4, 5, 6, 7, 8],
    "stop": [["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["g"], ["h"]],
}


@pytest.mark.parametrize("field", sorted(VALUES))
@pytest.mark.parametrize("top", range(len(SOURCES)))
def test_each_source_beats_every_source_below_it(field: str, top: int) -> None:
    # Sources 0..top each set the field; the highest of them wins and is recorded as its source.
    layers = [(SOURCES[i], Sampling(**{field: VALUES[field][i]})) for i in range(top + 1)]
    out = resolve_sampling(layers)
    assert getattr(out.sampling, field) == VALUES[field][top]
    assert out.sources == {field: SOURCES[top]}
    # A higher source that leaves the field unset (or None, as a full dump read back does) changes nothing.
    unset = [*layers, *((s, Sampling.model_validate(Sampling().model_dump())) for s in SOURCES[top + 1 :])]
    assert resolve_sampling(unset) == out


def test_extra_body_merges_key_by_key_with_a_source_per_key() -> None:
    out = resolve_sampling(
        [("config", Sampling(extra_body={"top_k": 5, "min_p": 0.1})), ("role", Sampling(extra_body={"top_k": 9}))]
    )
    assert out.sampling.extra_body == {"top_k": 9, "min_p": 0.1}
    assert out.sources == {"extra_body.top_k": "role", "extra_body.min_p": "config"}


def test_the_settings_layers_in_order(tmp_path: Path) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text("[sampling]\ntemperature = 0.25\ntop_p = 0.9\n[roles.verifier.sampling]\nmax_tokens = 111\n")
    settings = load_settings(config, {"sampling.max_tokens": 99}, {"TMAS_TOP_P": "0.5"})
    assert settings.sampling_sources == {"temperature": "config", "top_p": "env", "max_tokens": "flags"}
    solution = resolve_role(settings, "solution")
    assert (solution.sampling.temperature, solution.sampling.top_p, solution.sampling.max_tokens) == (0.25, 0.5, 99)
    assert solution.sources == {"temperature": "config", "top_p": "env", "max_tokens": "flags"}
    verifier = resolve_role(settings, "verifier", preset=Sampling(max_tokens=400, top_p=0.95))
    assert verifier.sampling.max_tokens == 111 and verifier.sources["max_tokens"] == "role"
    assert verifier.sampling.top_p == 0.5  # the preset fills only what no one set
    built_in = resolve_role(load_settings(None, environ={}), "solution")
    assert (built_in.sampling.temperature, built_in.sampling.max_tokens) == (0.7, 2048)
    assert built_in.sources == {"temperature": "built-in", "max_tokens": "built-in"}


def test_method_and_call_go_over_every_setting(tmp_path: Path) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text("[sampling]\ntemperature = 0.25\n[roles.solution.sampling]\ntemperature = 0.05\n")
    settings = load_settings(config, {"sampling.temperature": 0.6}, {})
    out = resolve_role(settings, "solution", method=Sampling(temperature=0.15), call=Sampling(max_tokens=48))
    assert (out.sampling.temperature, out.sampling.max_tokens) == (0.15, 48)
    assert out.sources == {"temperature": "method", "max_tokens": "call"}
    # Both set one field: the call's own need wins (a score-first verifier's short reply over the method's sampling).
    both = resolve_role(settings, "verifier", method=Sampling(max_tokens=900), call=Sampling(max_tokens=8))
    assert both.sampling.max_tokens == 8 and both.sources["max_tokens"] == "call"


def test_a_user_value_equal_to_the_built_in_one_still_beats_a_preset(tmp_path: Path) -> None:
    # temperature 0.7 is the built-in default; the paper preset asks for 1.0. Told apart by values alone (before
    # sources were kept), the user's 0.7 looked like the default and the preset's 1.0 was sent.
    config = tmp_path / "tmas.toml"
    config.write_text("[sampling]\ntemperature = 0.7\n")
    paper = TMASParams.model_validate({"preset": "paper"})
    preset, own = paper.sampling_layers("solution")
    out = resolve_role(load_settings(config, environ={}), "solution", preset=preset, method=own)
    assert (out.sampling.temperature, out.sampling.top_p) == (0.7, 0.95)
    assert out.sources["temperature"] == "config" and out.sources["top_p"] == "preset"
    # Without the file the preset fills it.
    out = resolve_role(load_settings(None, environ={}), "solution", preset=preset, method=own)
    assert out.sampling.temperature == 1.0 and out.sources["temperature"] == "preset"


def test_a_user_method_value_equal_to_the_presets_is_the_users() -> None:
    # The local preset's solution temperature is 0.3. A user who also asks for 0.3 as a method parameter set it:
    # it goes over the flag's 0.9 (method > flags), where a value equal to the preset's used to be taken as the
    # preset's and yield to the flag.
    mine = TMASParams.model_validate({"preset": "local", "sampling": {"solution": {"temperature": 0.3}}})
    preset, own = mine.sampling_layers("solution")
    assert preset is not None and preset.temperature == 0.3 and own == Sampling(temperature=0.3)
    flags = load_settings(None, {"sampling.temperature": 0.9}, {})
    out = resolve_role(flags, "solution", preset=preset, method=own)
    assert out.sampling.temperature == 0.3 and out.sources["temperature"] == "method"
    # The same preset without the user's own value yields to the flag.
    preset, own = TMASParams.model_validate({"preset": "local"}).sampling_layers("solution")
    assert own is None and resolve_role(flags, "solution", preset=preset, method=own).sampling.temperature == 0.9


def test_settings_without_sources_read_as_before() -> None:
    # Built in Python or stored before sources were kept: a value away from the built-in default is the user's,
    # one equal to it counts as the default (the only reading there was), so stored runs resume as they were.
    stored = Settings.model_validate(Settings(sampling=Sampling(temperature=0.7, top_p=0.5)).model_dump(mode="json"))
    assert stored.sampling_sources is None
    preset = Sampling(temperature=1.0, top_p=0.95)
    out = resolve_role(stored, "solution", preset=preset)
    assert (out.sampling.temperature, out.sampling.top_p) == (1.0, 0.5)
    # A flag on resume is recorded as such; the rest keeps the old reading.
    resumed = with_overrides(stored, {"sampling.max_tokens": 64})
    assert resumed.sampling_sources == {"top_p": "config", "max_tokens": "flags"}
    out = resolve_role(resumed, "solution", preset=Sampling(max_tokens=640, temperature=1.0))
    assert (out.sampling.temperature, out.sampling.top_p, out.sampling.max_tokens) == (1.0, 0.5, 64)


def test_sampling_laid_on_by_code_records_its_source() -> None:
    # A sweep's grid file, the difficulty filter and a served request set sampling of their own before any call:
    # with_sampling records it, so a grid's temperature equal to the built-in one still beats a preset.
    flags = load_settings(None, {"sampling.top_p": 0.5}, {})
    grid = with_sampling(flags, "config", Sampling(temperature=0.7, extra_body={"top_k": 20}))
    assert grid.sampling_sources == {"top_p": "flags", "temperature": "config", "extra_body.top_k": "config"}
    out = resolve_role(grid, "solution", preset=Sampling(temperature=1.0, top_p=0.95, max_tokens=640))
    assert (out.sampling.temperature, out.sampling.top_p, out.sampling.max_tokens) == (0.7, 0.5, 640)
    assert out.sources["temperature"] == "config" and out.sampling.extra_body == {"top_k": 20}
    # On settings that recorded no sources, what was there keeps the old reading beside the new layer's.
    stored = Settings(sampling=Sampling(temperature=0.7, top_p=0.5))
    served = with_sampling(stored, "flags", Sampling(max_tokens=64))
    assert served.sampling_sources == {"top_p": "config", "max_tokens": "flags"}
    assert with_sampling(stored, "flags", Sampling()) is stored


def test_recorded_sources_survive_the_stored_settings(tmp_path: Path) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text("[sampling]\ntemperature = 0.7\n")
    settings = load_settings(config, environ={})
    back = Settings.model_validate(settings.model_dump(mode="json"))
    assert back.sampling_sources == {"temperature": "config"}
    assert with_overrides(back, {"sampling.top_p": 0.5}).sampling_sources == {"temperature": "config", "top_p": "flags"}


async def test_every_call_records_its_sampling_and_sources(tmp_path: Path) -> None:
    settings = scripted_settings(method={"name": "tmas", "params": {"preset": "local", "iterations": 1}})
    model = ScriptedModel(SimScript(), with_overrides(settings, {"sampling.top_p": 0.8}))
    await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    with RunStore(tmp_path / "run", create=False) as store:
        calls = list(store.calls())
        assert calls
        for call in calls:
            assert call.call_id is not None
            sources = store.call_sampling_sources(call.call_id)
            sampling = store.call_sampling(call.call_id)
            # scripted_settings sets temperature 0.7 and max_tokens 256 in Python (no sources recorded): 0.7 reads as
            # the built-in default, which the preset replaces; 256 is the user's and beats the preset's max_tokens.
            assert sources == {
                "temperature": "preset",
                "max_tokens": "config",
                "top_p": "flags",
                "seed": "derived seed",
            }
            assert sampling["top_p"] == 0.8 and sampling["max_tokens"] == 256 and isinstance(sampling["seed"], int)
    bodies = [call.body for call in model.calls_of("solution")]
    assert bodies and {b["temperature"] for b in bodies} == {0.3}


def test_a_value_set_in_python_after_loading_is_the_users(tmp_path: Path) -> None:
    # Sources were recorded at load; a field changed afterwards in Python, with no record, still reads as set.
    settings = load_settings(None, environ={})
    changed = settings.model_copy(update={"sampling": settings.sampling.merged(Sampling(top_p=0.5, temperature=0.2))})
    out = resolve_role(changed, "solution", preset=Sampling(top_p=0.95, temperature=1.0))
    assert (out.sampling.top_p, out.sampling.temperature) == (0.5, 0.2)
    assert out.sources["top_p"] == "config" and out.sources["temperature"] == "config"


# ------------------------------------------------------------------------------------------------ a configured seed
def test_sample_j_goes_with_the_seed_plus_j_configured_or_derived() -> None:
    configured = resolve_sampling([("config", Sampling(seed=5))])
    assert [for_sample(configured, j).sampling.seed for j in range(4)] == [5, 6, 7, 8]
    assert for_sample(configured, 3).sources["seed"] == "config"
    # A derived seed is the prompt's step's: its samples go with it + j too (before, each call's hash went as it was).
    derived = configured.over(DERIVED_SEED, Sampling(seed=99))
    assert for_sample(derived, 3).sampling.seed == 102 and for_sample(derived, 3).sources["seed"] == DERIVED_SEED
    # A retry's seed is its own already; no seed stays none.
    assert for_sample(configured.over(RETRY_SEED, Sampling(seed=99)), 3).sampling.seed == 99
    assert for_sample(resolve_sampling([]), 3).sampling.seed is None
    # A derived base leaves room for every sample's seed + j below 2^31.
    assert all(0 <= derived_base("run", p, 0, "solution") <= (1 << 31) - 1 - SAMPLE_SEEDS for p in range(200))


def test_a_retrys_seed_is_never_another_samples_of_the_same_prompt() -> None:
    # The first sample seed whose retry hash lands within SAMPLE_SEEDS of it (about one in 512): drawn as it was, the
    # retry could send seed + j of another sample j. It is drawn again, away from every sample's seed.
    def first_draw(seed: int) -> int:
        return int.from_bytes(hashlib.sha256(repr((seed, 1)).encode()).digest()[:4], "big") >> 1

    seed = next(s for s in range(1_000_000) if abs(first_draw(s) - s) < SAMPLE_SEEDS)
    again = retried(resolve_sampling([("config", Sampling(seed=seed))]), 1)
    assert again.sources["seed"] == RETRY_SEED and abs((again.sampling.seed or 0) - seed) >= SAMPLE_SEEDS
    # Elsewhere the retry's seed is the one it always was (a stored retry replays), and each attempt its own.
    far = next(s for s in range(1_000_000) if abs(first_draw(s) - s) >= SAMPLE_SEEDS)
    assert retried(resolve_sampling([("config", Sampling(seed=far))]), 1).sampling.seed == first_draw(far)
    assert retried(resolve_sampling([("config", Sampling(seed=far))]), 0).sampling.seed == far


def test_the_seeds_earlier_versions_sent_under_a_configured_seed_name_none_a_new_run_sends_for_another_call() -> None:
    # Earlier versions sent every sample the configured seed (7) on its first attempt, and a retry either 7 again or
    # the seed drawn from 7 and the attempt. A resumed run looks its calls up under those too.
    def first_draw(seed: int, attempt: int) -> int:
        return int.from_bytes(hashlib.sha256(repr((seed, attempt)).encode()).digest()[:4], "big") >> 1

    assert earlier_configured_seeds(7, 3, 0) == (7,)
    assert earlier_configured_seeds(7, 3, 2) == (first_draw(7, 2), 7)
    # Draw 0 is sent 7 on its first attempt by this version too: nothing earlier to look for. Its retry under the same
    # key is never looked up under 7, where this version keeps the unusable first reply.
    assert earlier_configured_seeds(7, 0, 0) == ()
    assert earlier_configured_seeds(7, 0, 1) == (first_draw(7, 1),)
