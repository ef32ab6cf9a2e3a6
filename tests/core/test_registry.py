"""Registries (preempt.core.registry): one home per kind of plug-in. Built-in names
resolve to their classes, a user's class is used by import path or by decorator without
editing preempt, and a bad name fails with the choices, naming the key once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from preempt.core.config import ConfigError
from preempt.core.registry import (
    CODECS,
    EARLY_SAVE_POLICIES,
    PREEMPTION_MODES,
    RECLAIM_CODECS,
    SCHEDULING_POLICIES,
    Registry,
    save_codec,
)
from preempt.core.request import Request, RequestState
from preempt.early.early_save import EarlySavePolicy, ProjectionPolicy
from preempt.engine.engine import Engine
from preempt.engine.policies import PriorityScorePolicy, SchedulingPolicy, VllmFcfsPolicy
from tests.conftest import small_config


class ShortestPromptFirst(SchedulingPolicy):
    """A user's policy: admit short prompts first, preempt the longest."""

    def admission_key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(running, key=lambda r: (r.num_prompt_tokens, r.arrival_s))


class SaveTheOldest(EarlySavePolicy):
    """A user's early-save policy: the oldest running request."""

    def select(self, running, features, now):
        return [min(running, key=lambda r: r.arrival_s)] if running else []


def test_builtin_names_resolve_to_their_classes():
    assert SCHEDULING_POLICIES.resolve("vllm_fcfs") is VllmFcfsPolicy
    assert SCHEDULING_POLICIES.resolve("priority_score") is PriorityScorePolicy
    assert EARLY_SAVE_POLICIES.resolve("projection") is ProjectionPolicy
    assert EARLY_SAVE_POLICIES.resolve("none") is None
    for registry in (SCHEDULING_POLICIES, EARLY_SAVE_POLICIES):
        for name in registry.names():
            registry.resolve(name)  # every built-in path imports


def test_a_users_policy_runs_by_import_path():
    config = small_config(scheduler={"policy": "tests.core.test_registry:ShortestPromptFirst"})
    engine = Engine(config)
    assert isinstance(engine.scheduler.policy, ShortestPromptFirst)
    from tests.kv.test_preemption import _workload

    requests = _workload()
    engine.run(requests)
    assert all(r.state is RequestState.FINISHED for r in requests)


def test_a_users_early_save_policy_runs_by_import_path():
    config = small_config(
        preemption={"mode": "swap"}, early_save={"policy": "tests.core.test_registry.SaveTheOldest"}
    )
    engine = Engine(config)
    assert isinstance(engine.early_saver.policy, SaveTheOldest)


def test_a_decorator_registers_a_name():
    registry = Registry("thing.kind", "thing", {"a": "preempt.engine.policies:VllmFcfsPolicy"})

    @registry.register("b")
    class B:
        pass

    assert registry.names() == ["a", "b"] and registry.resolve("b") is B and registry.check("b") == "b"
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.register("a")(B)


@pytest.mark.parametrize(
    ("section", "name", "message"),
    [
        ("scheduler", "lottery", r"unknown policy 'lottery'; choose one of \['fastserve_mlfq'"),
        ("scheduler", "no_such_module:Policy", "cannot import no_such_module"),
        ("scheduler", "tests.core.test_registry:Nope", "tests.core.test_registry has no Nope"),
        ("early_save", "psychic", "unknown early-save policy 'psychic'"),
    ],
)
def test_a_bad_name_names_the_key_once_and_the_choices(section, name, message):
    with pytest.raises(ConfigError, match=message) as err:
        small_config(**{section: {"policy": name}})
    assert str(err.value).count(f"{section}.policy") == 1


def test_a_class_of_the_wrong_kind_is_refused():
    from preempt.early.early_save import make_policy
    from preempt.engine.policies import get_policy

    with pytest.raises(ValueError, match="is not a preempt.engine.policies.SchedulingPolicy subclass"):
        get_policy("tests.core.test_registry:SaveTheOldest")
    config = small_config(
        preemption={"mode": "swap"}, early_save={"policy": "tests.core.test_registry:ShortestPromptFirst"}
    )
    with pytest.raises(ConfigError, match="is not a preempt.early.early_save.EarlySavePolicy subclass"):
        make_policy(config.early_save)


def test_every_codec_resolves_to_a_codec_of_its_name_and_the_modes_name_registered_codecs():
    from preempt.kv.codec import CODECS as CODEC_CLASSES
    from preempt.kv.codec import Codec

    classes = [CODECS.resolve(name) for name in CODECS.names()]
    assert all(isinstance(cls, type) and issubclass(cls, Codec) for cls in classes)
    assert [cls.name for cls in classes] == CODECS.names()  # the registered name is the codec's own
    assert len({cls.codec_id for cls in classes}) == len(classes)  # blobs say their codec by id
    assert dict(CODEC_CLASSES) == dict(zip(CODECS.names(), classes, strict=True))  # codec.py reads it
    saved = {codec for codec in PREEMPTION_MODES.values() if codec is not None}
    assert saved <= set(CODECS.names()) and set(RECLAIM_CODECS) <= set(CODECS.names())
    assert all(CODECS.resolve(name).is_lossless for name in RECLAIM_CODECS)
    # pause saves only when reclaimed (or forced): with reclaim_codec; every other saving mode with its own
    assert save_codec("pause", "zstd") == "zstd" and save_codec("swap_mixed", "zstd") == "mixed"
    # swap_<name> for every registered codec, with no line of its own
    assert [save_codec(f"swap_{name}", "raw") for name in CODECS.names()] == CODECS.names()


def test_config_modes_and_reclaim_codecs_are_the_registrys():
    for mode in PREEMPTION_MODES:
        assert small_config(preemption={"mode": mode}).preemption.mode == mode
    for name in RECLAIM_CODECS:
        assert small_config(preemption={"reclaim_codec": name}).preemption.reclaim_codec == name


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mode", "swap_gzip", r"unknown preemption mode 'swap_gzip'; choose one of \['recompute', 'swap', "),
        ("reclaim_codec", "gzip", r"codec 'gzip' is not a registered codec; choose one of \['raw', 'zstd'\]"),
        ("reclaim_codec", "mixed", r"codec 'mixed' cannot save a paused request; choose one of \['raw'"),
    ],
)
def test_a_bad_mode_or_codec_names_the_key_once_and_the_choices(key, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        small_config(preemption={key: value})
    assert str(err.value).count(f"preemption.{key}") == 1


def test_a_codec_registered_by_decorator_is_made_and_decoded_by_name(monkeypatch):
    import torch

    from preempt.core import registry
    from preempt.kv.codec import CODECS as CODEC_CLASSES
    from preempt.kv.codec import RawCodec, decode_blob, make_codec

    # a copy of the registry, so the decorator leaves the real one as it was
    monkeypatch.setattr(registry, "CODECS", Registry(CODECS.kind, CODECS.noun, dict(CODECS._paths)))

    @registry.CODECS.register("raw_copy")
    class RawCopy(RawCodec):
        name = "raw_copy"
        codec_id = 200

    assert CODEC_CLASSES["raw_copy"] is RawCopy and isinstance(make_codec("raw_copy"), RawCopy)
    kv = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(decode_blob(make_codec("raw_copy").encode(kv)), kv)
    assert "raw_copy" not in CODECS.names()
