"""`preempt serve` and `tokenizer`: the HTTP server (its flags and its command are
preempt.serve's own) and the byte-level tokenizer its load generators count tokens with.
"""

from __future__ import annotations

import argparse
import sys


def add_serve_command(serve: argparse.ArgumentParser) -> None:
    """The server's own flags and command on the `serve` subparser, or, without its
    packages, a command that names what is missing (and takes any flags)."""
    try:
        from preempt.serve import add_serve_arguments, cmd_serve  # fastapi, uvicorn: ~0.4 s
    except ImportError as err:
        # Where the server's packages are missing (the offline GPU machine), every other
        # command still runs; `serve` says what is missing instead of the CLI failing whole.
        serve.set_defaults(
            func=lambda _args, err=err: _missing(f"preempt serve needs {err.name}: {err}"), any_flags=True
        )
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=cmd_serve)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """The served tiny model's tokenizer as a Hugging Face directory: token id i is byte
    i, as `preempt.model.tokenizer.ByteTokenizer` (an `hf` checkpoint's directory already
    holds its own). Load generators count tokens with it, offline."""
    from preempt.model.tokenizer import write_byte_tokenizer

    try:
        write_byte_tokenizer(args.out)
    except ImportError as err:
        return _missing(f"preempt tokenizer needs {err.name} (pip install tokenizers): {err}")
    except OSError as err:
        print(f"preempt tokenizer: error: cannot write {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'tokenizer.json'} and {args.out / 'tokenizer_config.json'}")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """A random-weight Llama that `vllm serve DIR` loads offline (preempt.model.random_llama)."""
    from preempt.model.random_llama import PRESETS, num_params, write_random_llama

    try:
        write_random_llama(args.out, args.preset, args.seed)
    except ImportError as err:
        return _missing(f"preempt checkpoint needs {err.name} (pip install transformers): {err}")
    except OSError as err:
        print(f"preempt checkpoint: error: cannot write {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    spec = PRESETS[args.preset]
    print(
        f"wrote {args.out} ({args.preset}: {num_params(args.preset) / 1e6:.1f}M parameters, {spec.dtype}, "
        "random weights: its text is noise)"
    )
    return 0


def _missing(message: str) -> int:
    print(f"preempt: error: {message}", file=sys.stderr)
    return 2
