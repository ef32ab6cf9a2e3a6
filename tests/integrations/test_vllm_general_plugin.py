"""preempt's vLLM general plugin (preempt/integrations/vllm/plugin.py) on vLLM-shaped configs,
in preempt's own environment: it picks the scheduler class for vLLM's async setting and
refuses bad settings (the real `vllm serve` run is tests/integrations/test_vllm_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from preempt.integrations.vllm.plugin import check_config
from preempt.integrations.vllm.settings import ASYNC_PLUGIN_CLS, PLUGIN_CLS, SettingsError


def vllm_config(scheduler_cls, async_scheduling: bool, preempt: dict | None = None):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls, async_scheduling=async_scheduling),
        additional_config={"preempt": preempt or {}},
        kv_transfer_config=None,
    )


@pytest.mark.parametrize("named", [PLUGIN_CLS, ASYNC_PLUGIN_CLS])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_plugin_runs_on_the_scheduler_class_of_vllms_async_setting(named, async_scheduling):
    config = vllm_config(named, async_scheduling)
    check_config(config)
    assert config.scheduler_config.scheduler_cls == (ASYNC_PLUGIN_CLS if async_scheduling else PLUGIN_CLS)


def test_other_schedulers_are_left_alone_and_bad_settings_refused():
    config = vllm_config("my_module.MyScheduler", True)
    check_config(config)
    assert config.scheduler_config.scheduler_cls == "my_module.MyScheduler"
    with pytest.raises(SettingsError, match="policy"):
        check_config(vllm_config(PLUGIN_CLS, True, {"policy": "no_such_module:Nope"}))
