"""Model code of the engine: the `tiny` Llama-style decoder, paged attention, tokenizer,
checkpoint loaders (`checkpoint` for the reference LM, `hf` for Llama/Qwen2).

Owns: modules and pure tensor functions. It never allocates the KV pool (kv_cache does),
never decides what runs (the scheduler does) and never samples (the model runner does).

Import the submodules directly (`from preempt.model.tiny import TinyLM`): this package
file imports nothing, so `preempt.model.tokenizer` (the server, the CLI) does not pull in
torch.
"""
