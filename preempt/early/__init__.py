"""Early saves and restores ahead: whom to copy to the host before a preemption strikes,
and whose saved KV to bring back before it is admitted.

`early_save` holds the saver the engine calls after each step and its policies (chosen by
`early_save.policy` through `preempt.core.registry.EARLY_SAVE_POLICIES`); they read
`features` (what a policy may know of a running request), `lookahead` (the oracle that
forks the engine, and the rolling forecast), `projection` (each running request run to its
expected end against the free blocks) and `online_predictor` (the trained LSTM, streaming).
`prefetch` starts restores for the next admissions.

The step never imports this package: `preempt.engine.engine` builds the saver and the
prefetcher by name (`preempt.core.registry.STEP_HOOKS`) and calls them with the engine's
view (`preempt.engine.view.EngineView`). Imports `preempt.core`, `preempt.kv` and
`preempt.engine`; never `preempt.obs` or anything above it.
"""

from preempt.core.registry import EARLY_SAVE_POLICIES, STEP_HOOKS

# The early-save policies, by the name `early_save.policy` gives them, and the hooks the
# engine builds by name (imported when first built).
EARLY_SAVE_POLICIES.add("none", None)
EARLY_SAVE_POLICIES.add("always", "preempt.early.early_save:AlwaysPolicy")
EARLY_SAVE_POLICIES.add("rule", "preempt.early.early_save:RulePolicy")
EARLY_SAVE_POLICIES.add("lstm", "preempt.early.early_save:LSTMPolicy")
EARLY_SAVE_POLICIES.add("oracle", "preempt.early.early_save:OraclePolicy")
EARLY_SAVE_POLICIES.add("lookahead", "preempt.early.early_save:LookaheadPolicy")
EARLY_SAVE_POLICIES.add("forecast", "preempt.early.early_save:ForecastPolicy")
EARLY_SAVE_POLICIES.add("projection", "preempt.early.early_save:ProjectionPolicy")
STEP_HOOKS.add("early_saver", "preempt.early.early_save:build_early_saver")
STEP_HOOKS.add("prefetcher", "preempt.early.prefetch:Prefetcher")
