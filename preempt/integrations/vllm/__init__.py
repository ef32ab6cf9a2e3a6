"""preempt inside vLLM 0.32: its policy as a V1 scheduler plugin, its save and restore as a
KV connector.

`vllm serve MODEL --scheduler-cls preempt.integrations.vllm.scheduler.PreemptScheduler
[--kv-transfer-config '{"kv_connector": "PreemptKVConnector", "kv_connector_module_path":
"preempt.integrations.vllm.connector", ...}']` (docs/vllm_plugin.md). Modules, by where
they may run:

- `settings`, `clock`, `decider`, `metrics`, `saves`, `kv_store`: plain Python and tensors
  (pydantic, preempt's deciding code, its codecs and host pool); importable anywhere,
  tested in preempt's own environment.
- `plugin`: vLLM's general plugin (entry point `vllm.general_plugins`): checks preempt's
  settings where vLLM builds its config, before the engine core starts; imports vLLM
  only where vLLM already has.
- `scheduler` (the `Scheduler` subclass), `connector` (the KV connector), `stat_logger`
  and `peer` (the driver `preempt bench vllm` and the tests start in the peer
  virtualenv): import vLLM; never import them from preempt.
"""
