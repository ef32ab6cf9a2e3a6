"""`preempt`'s deciding code inside other serving engines.

Each sub-package adapts one engine; it imports that engine only in modules that run inside
the engine's own environment, never from `preempt`'s import paths (`vllm/`: a vLLM 0.32 V1
scheduler plugin, run in the peer virtualenv of `make peer`).
"""
