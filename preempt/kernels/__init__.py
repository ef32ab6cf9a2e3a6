"""Triton kernels of the KV save/restore path, one file per kernel, each with a thin
wrapper and a torch reference (`*_ref`). See the kernels issue."""
