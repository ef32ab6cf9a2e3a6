"""`preempt serve`: the engine behind an OpenAI-compatible HTTP server, on the wall clock.

Modules, each owning one part (their docstrings say what they must never do):

- `engine_loop`: the engine thread, its command queue and the asyncio bridge;
- `protocol`: request bodies, OpenAI-shaped errors, validation messages;
- `chat`: chat messages -> prompt (checkpoint chat templates) and EOS ids;
- `handlers`: the generation routes (sampling params, stop strings, n, logprobs, SSE);
- `app`: the FastAPI app (auth, error handlers, body limit/timeout, OpenAPI);
- `args`: the command line and uvicorn (header timeout, connection cap, SIGTERM);
- `weights`: which weights are served (the reference LM of `make run` by default) and the
  startup line that names them.

The layers import downwards only: args -> app -> handlers -> engine_loop/protocol/chat;
args and app -> weights.
See docs/serving.md.
"""

from preempt.serve.app import create_app
from preempt.serve.args import PreemptServer, add_serve_arguments, cmd_serve, config_from_args, main, serve
from preempt.serve.engine_loop import EngineLoop

__all__ = [
    "EngineLoop",
    "PreemptServer",
    "add_serve_arguments",
    "cmd_serve",
    "config_from_args",
    "create_app",
    "main",
    "serve",
]
