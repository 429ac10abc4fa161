"""adaptive_eager.config: every setting parsed in one place, with one-line errors."""

import os

import pytest

from adaptive_eager.config import VARIABLES, Config, ConfigError, from_env, resolve


def test_defaults(monkeypatch):
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO")  # conftest turns them off
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO")
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_CPP_WRAPPER")
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_WARM_START")
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", raising=False)  # a suite's choice
    c = resolve()
    assert c == Config()
    assert c.devices == ("neuron",)
    assert c.backend_for("cpu") == "inductor"


def test_keywords_override_environment(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_BACKEND", "exact")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "5")
    assert resolve().backend == "exact"
    assert resolve().hot_threshold == 5
    assert resolve(backend="inductor", hot_threshold=3).backend == "inductor"
    assert resolve(hot_threshold=3).hot_threshold == 3


def test_devices_parsed_and_deduplicated(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_DEVICES", " CPU, cuda,cpu")
    assert resolve().devices == ("cpu", "cuda")
    assert resolve(devices=["neuron"]).devices == ("neuron",)


@pytest.mark.parametrize(
    "keyword, value, accepted",
    [
        ("backend", "foo", "'exact', 'inductor'"),
        ("devices", ("cpu", "tpu"), "'cpu', 'cuda', 'neuron'"),
        ("hot_threshold", 0, ">= 1"),
        ("hot_threshold", 2.5, "an integer"),
        ("cache_size", "many", "an integer"),
        ("crosscheck", "maybe", "0 or 1"),
    ],
)
def test_bad_keyword_names_value_and_accepted(keyword, value, accepted):
    with pytest.raises(ConfigError) as info:
        resolve(**{keyword: value})
    message = str(info.value)
    assert "\n" not in message
    assert repr(value) in message and accepted in message and keyword in message


def test_bad_environment_value_is_one_line(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_DEBUG", "9")
    values, errors = from_env()
    assert "debug" not in values
    assert errors == [
        "adaptive_eager: NEURON_ADAPTIVE_EAGER_DEBUG='9' is not valid; "
        "accepted: an integer >= 0 and <= 4"
    ]
    with pytest.raises(ConfigError):
        resolve()


def test_unknown_keyword():
    with pytest.raises(TypeError, match="unknown setting 'speed'"):
        resolve(speed=3)


def test_every_variable_documented_and_parseable():
    names = [v.env for v in VARIABLES]
    assert len(names) == len(set(names))
    for v in VARIABLES:
        assert v.env.startswith(("NEURON_ADAPTIVE_EAGER", "NEURON_EMULATOR")) and v.doc
        if v.field != "autoload" and v.engine:
            assert hasattr(Config(), v.field)


def test_the_cache_directory_is_an_absolute_path(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_CACHE_DIR", "~/warm")
    assert resolve().cache_dir == os.path.expanduser("~/warm")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_CACHE_DIR", "relative/warm")
    with pytest.raises(ConfigError, match="NEURON_ADAPTIVE_EAGER_CACHE_DIR='relative/warm'"
                                          ".*accepted: an absolute directory path"):
        resolve()
