"""`register`: vLLM's general plugin. A bad plugin or connector setting fails where vLLM
builds its config, before it starts an engine core.

The scheduler and the connector read their settings in vLLM's engine-core process, when
vLLM builds them there. A bad value raised at that point surfaced ~25 s into a `vllm
serve` start, after the model had loaded, at line ~80 of ~180: the API server then printed
its own "Engine core initialization failed" traceback and a resource tracker's warning
below it. vLLM 0.32 gives a plugin no hook that sees the finished config before the engine
core starts: general plugins (`vllm.general_plugins`, loaded from preempt's entry point,
pyproject.toml) run in every process with no arguments, and in the API server before the
command line is parsed (`AsyncEngineArgs.add_cli_args`). So `register` wraps
`EngineArgs.create_engine_config`, which every start goes through after parsing (`vllm
serve`'s API servers, `LLM(...)`, `AsyncLLM.from_engine_args`): the wrapper reads the
settings with the engine core's own functions and raises their error, so `vllm serve`
stops with a traceback whose last line names the field, no engine core having started.

The settings come from the same places the engine core reads: `additional_config` or
$PREEMPT_VLLM_CONFIG (inherited by the engine core) for the scheduler, the
`--kv-transfer-config`'s `kv_connector_extra_config` for the connector. Without the entry
point (preempt on PYTHONPATH only, or left out of a `VLLM_PLUGINS` allowlist) the engine
core still raises the same error, later.

vLLM loads this module in every process it starts, so it imports nothing of vLLM's, and
preempt's settings only for a config that names a scheduler class or preempt's connector.
"""

from __future__ import annotations

import functools
import sys

PLUGIN_PACKAGE = "preempt."
_WRAPPED = "_preempt_checks_settings"


def register() -> None:
    """Wrap `EngineArgs.create_engine_config` to check preempt's settings; once per process."""
    # Only where vLLM's arg_utils is already loaded: the processes that build a config from
    # arguments load it before they load plugins (load_general_plugins is called from it),
    # and the engine core and workers, which get a finished config, need no check.
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is None:
        return
    engine_args = arg_utils.EngineArgs
    create = engine_args.create_engine_config
    if getattr(create, _WRAPPED, False):
        return

    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        check_config(config)
        return config

    setattr(create_engine_config, _WRAPPED, True)
    engine_args.create_engine_config = create_engine_config


def check_config(vllm_config) -> None:
    """Raise the error the engine core would raise for preempt's settings in `vllm_config`
    (`SettingsError`, `ConnectorSettingsError`); nothing when it names neither the plugin
    scheduler nor preempt's connector. A plugin scheduler named by its string is set to the
    class of vLLM's async setting: vLLM keeps `async_scheduling` whatever class is named,
    and only the `AsyncScheduler` one keeps up with it (scheduler.py)."""
    scheduler_config = vllm_config.scheduler_config
    scheduler = scheduler_config.scheduler_cls
    if scheduler is not None and _is_plugin_scheduler(scheduler):
        from preempt.integrations.vllm.settings import ASYNC_PLUGIN_CLS, PLUGIN_CLS, load_settings

        load_settings(vllm_config.additional_config)
        if isinstance(scheduler, str):
            scheduler_config.scheduler_cls = (
                ASYNC_PLUGIN_CLS if scheduler_config.async_scheduling else PLUGIN_CLS
            )
    transfer = vllm_config.kv_transfer_config
    module_path = getattr(transfer, "kv_connector_module_path", None) or ""
    if module_path.startswith(PLUGIN_PACKAGE):
        # kv_store imports torch, which vLLM has loaded wherever it builds a config
        from preempt.integrations.vllm.kv_store import CONNECTOR_CLS, CONNECTOR_MODULE, check_transfer_config

        if module_path == CONNECTOR_MODULE and transfer.kv_connector == CONNECTOR_CLS:
            check_transfer_config(transfer)


def _is_plugin_scheduler(scheduler: str | type) -> bool:
    # A name (what --scheduler-cls gives), or a class: preempt's or a subclass of it. Compared
    # by name: no scheduler module is imported here (vLLM imports it in the engine core).
    from preempt.integrations.vllm.settings import ASYNC_PLUGIN_CLS, PLUGIN_CLS

    names = (PLUGIN_CLS, ASYNC_PLUGIN_CLS)
    if isinstance(scheduler, str):
        return scheduler in names
    return any(f"{cls.__module__}.{cls.__qualname__}" in names for cls in getattr(scheduler, "__mro__", ()))
