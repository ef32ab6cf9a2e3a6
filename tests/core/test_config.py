import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from preempt.core.config import ConfigError, EngineConfig, build_config
from preempt.core.config_files import BUNDLED_CONFIGS, find_config_file, load_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_frozen():
    config = load_config()
    assert config == EngineConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.seed = 3  # type: ignore[misc]


def test_file_and_overrides_keep_types(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"scheduler": {"max_num_seqs": 8}, "seed": 1}))
    config = load_config(path, ["scheduler.policy=vllm_priority", "workload.sla_mix={0: 0.5, 3: 0.5}"])
    assert config.scheduler.max_num_seqs == 8 and config.seed == 1
    assert config.scheduler.policy == "vllm_priority"
    assert config.workload.sla_mix == {0: 0.5, 3: 0.5}


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  backend: null\ncache:\n  num_blocks: 64\n")
    config = load_config(path)
    assert config.model.backend == "null" and config.cache.num_blocks == 64


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("scheduler.bogus=1", "unknown config key 'scheduler.bogus'$"),
        ("nosuchsection.x=1", "unknown config key 'nosuchsection'$"),
        (
            "preemption.treshold=0.1",
            r"unknown config key 'preemption.treshold' \(did you mean 'preemption.threshold'\?\)",
        ),
        ("preemption.priority_weights.agee=1", r"\(did you mean 'preemption.priority_weights.age'\?\)"),
        ("schedular.policy=vllm_fcfs", r"unknown config key 'schedular' \(did you mean 'scheduler'\?\)"),
        ("scheduler.max_num_seqs=0", "'scheduler.max_num_seqs'"),
        ("scheduler.max_num_seqs=many", "'scheduler.max_num_seqs'"),
        ("scheduler.policy=lottery", "unknown policy 'lottery'"),
        ("clock.target=tpu", "unknown target 'tpu'"),
        ("workload.sla_mix={0: 0.3}", "sum to 1"),
        ("slo.ttft_s={1: 2.0}", "level 0"),
        ("novalue", "key=value"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid json"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_a_bundled_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    """`preempt run --config engine_quick.yaml` (and every reader of an engine config:
    serve, ablate, tune) outside the repository's root: the bundled one."""
    assert BUNDLED_CONFIGS == REPO / "preempt" / "configs"
    monkeypatch.chdir(tmp_path)
    assert find_config_file("engine_quick.yaml") == BUNDLED_CONFIGS / "engine_quick.yaml"
    assert load_config("engine_quick.yaml") == load_config(BUNDLED_CONFIGS / "engine_quick.yaml")
    assert load_config("engine_quick.yaml") != EngineConfig()  # it did read something


def test_a_file_where_it_is_given_wins_over_the_bundled_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "engine_quick.yaml").write_text("seed: 7\n")
    assert find_config_file("engine_quick.yaml") == Path("engine_quick.yaml")
    assert load_config("engine_quick.yaml") == EngineConfig(seed=7)
    # relative to a directory (an ablation's base_config, beside its file): there first
    (tmp_path / "sub").mkdir()
    assert (
        find_config_file("engine_quick.yaml", beside=tmp_path / "sub")
        == BUNDLED_CONFIGS / "engine_quick.yaml"
    )
    (tmp_path / "sub" / "engine_quick.yaml").write_text("seed: 8\n")
    assert (
        find_config_file("engine_quick.yaml", beside=tmp_path / "sub")
        == tmp_path / "sub" / "engine_quick.yaml"
    )


def test_a_missing_config_names_every_place_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("no_such.yaml")
    message = str(err.value)
    assert message.startswith("config file not found: no_such.yaml (looked for ")
    assert str(tmp_path / "no_such.yaml") in message and str(BUNDLED_CONFIGS / "no_such.yaml") in message
    # an absolute path is looked for where it says, only
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "engine_quick.yaml")
    assert str(BUNDLED_CONFIGS) not in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "new"),
    [
        ("zstd_level", 5, "preemption.codecs.zstd.level"),
        ("head_plan", "fp8", "preemption.codecs.mixed.plan"),
        ("codec_encode_mb_s", {"zstd": 100.0}, "clock.codecs.<codec>.encode_mb_s"),
    ],
)
def test_a_moved_key_is_refused_with_its_new_place(key, value, new):
    with pytest.raises(ConfigError, match=f"key 'preemption.{key}' has moved: set '{re.escape(new)}'"):
        build_config({"preemption": {key: value}})


def test_codec_options_and_calibration_are_checked_by_the_codec():
    config = build_config(
        {"preemption": {"codecs": {"zstd": {"level": 5}}}, "clock": {"codecs": {"zstd": {"encode_mb_s": 90}}}}
    )
    assert config.preemption.codecs == {"zstd": {"level": 5}}
    assert config.clock.codecs["zstd"].encode_mb_s == 90
    for bad, message in [
        ({"preemption": {"codecs": {"gzip": {}}}}, "unknown codec 'gzip'"),
        ({"preemption": {"codecs": {"zstd": {"levle": 5}}}}, "codec 'zstd'.*levle"),
        ({"preemption": {"codecs": {"mixed": {"plan": "nowhere.json"}}}}, "neither fp16, fp8, random"),
        ({"clock": {"codecs": {"zstd": {"encode_mb_s": -1}}}}, "clock.codecs.zstd.encode_mb_s"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(bad)


def test_stored_configs_are_read_in_todays_layout():
    from preempt.core.config import upgrade_config

    old = {
        "seed": 0,
        "clock": {"kind": "virtual"},
        "preemption": {
            "mode": "swap_mixed",
            "head_plan": "fp8",
            "zstd_level": 3,
            "codec_encode_mb_s": {"raw": 0.0, "zstd": 480.0},
        },
    }
    new = upgrade_config(old)
    assert new["preemption"] == {
        "mode": "swap_mixed",
        "codecs": {"mixed": {"plan": "fp8"}, "zstd": {"level": 3}},
    }
    assert new["clock"]["codecs"] == {"raw": {"encode_mb_s": 0.0}, "zstd": {"encode_mb_s": 480.0}}
    assert "head_plan" in old["preemption"]  # the stored dict is left as it was
    today = build_config({}).model_dump(mode="json")
    assert upgrade_config(today) is today
