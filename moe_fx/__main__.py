"""Command line: ``python -m moe_fx demo | explain``.

* ``demo``: a tiny random Qwen3-MoE language model compiled with ``backend="moe_fx"`` on CPU: prints the
  explain report, the largest logit difference from eager, and greedy ``generate()`` tokens of both.
* ``explain``: the explain report for a tiny model of a chosen family and experts implementation.

Sizes are bounded (``--layers`` 1 to 48, ``--tokens`` 1 to 256); anything else is a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["main"]


def _tiny_model(family: str, impl: str, layers: int, dtype: torch.dtype):
    from moe_fx.testing.models import tiny_hf_model

    return tiny_hf_model(family, num_layers=layers, experts_implementation=impl, dtype=dtype)


def demo(args: argparse.Namespace) -> int:
    """Compile a tiny Qwen3-MoE with moe_fx, compare with eager, generate 16 tokens with both."""
    import moe_fx

    start = time.perf_counter()
    torch.manual_seed(0)
    _progress(f"[demo] building a tiny Qwen3-MoE ({args.layers} layers) and tracing it for the explain report ...")
    model = _tiny_model("qwen3_moe", args.impl, args.layers, torch.float32)
    prompt = torch.randint(0, model.config.vocab_size, (1, 12))
    print(f"tiny Qwen3-MoE: {args.layers} layers, E=8, K=2, H=32, I=16, experts_implementation={args.impl}")
    print(moe_fx.explain(model, prompt, dynamic=True))  # as compiled below

    _progress("[demo] compiling with moe_fx (Inductor on CPU: this takes most of the minute) ...")
    compiled = _tiny_model("qwen3_moe", args.impl, args.layers, torch.float32)
    compiled.load_state_dict(model.state_dict())
    compiled.forward = moe_fx.compile(compiled.forward, dynamic=True)
    with torch.no_grad():
        want = model(prompt).logits
        got = compiled(prompt).logits
        diff = (got - want).abs().max().item()
        print(f"largest |compiled - eager| logit difference: {diff:.3e}")
        gen = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
        _progress(f"[demo] generating {args.tokens} tokens with eager and with the compiled model ...")
        eager_tokens = model.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
        moe_fx_tokens = compiled.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
    print(f"eager  generate: {eager_tokens}")
    print(f"moe_fx generate: {moe_fx_tokens}")
    same = eager_tokens == moe_fx_tokens
    print(f"greedy tokens {'agree' if same else 'DIFFER'}; demo took {time.perf_counter() - start:.1f} s")
    return 0 if same and diff < 1e-3 else 1


def _progress(message: str) -> None:
    """One progress line on stderr, shown at once (the steps take seconds each)."""
    print(message, file=sys.stderr, flush=True)


def explain_cmd(args: argparse.Namespace) -> int:
    """Print the explain report of a tiny model of ``args.family``."""
    import moe_fx
    from moe_fx.testing.families import tiny_family_model

    dtype = getattr(torch, args.dtype)
    _progress(f"[explain] building a tiny {args.family} model ({args.layers} layers) and tracing it ...")
    model = tiny_family_model(args.family, dtype=dtype, experts_implementation=args.impl, num_layers=args.layers)
    prompt = torch.randint(0, model.config.vocab_size, (1, 8))
    print(moe_fx.explain(model, prompt, dynamic=True if args.dynamic else None))
    return 0


#: What ``--help`` prints above the commands (plain text: the module docstring is reST for the docs).
DESCRIPTION = """\
Run moe_fx on tiny random models, on CPU, to see what it does.

  demo     compile a tiny Qwen3-MoE language model with backend="moe_fx", compare its logits and
           greedy generate() tokens with eager (about a minute on a laptop CPU)
  explain  print the explain report (what moe_fx does to each MoE layer) of a tiny model of any
           transformers MoE family

Sizes are bounded: --layers 1 to 48, --tokens 1 to 256."""
#: transformers' traceable experts implementations (``config._experts_implementation``).
IMPLS = ("grouped_mm", "batched_mm")
IMPL_HELP = "transformers' experts implementation the model uses (default grouped_mm)"
#: Most decoder layers a tiny model may have (``--layers``): a few seconds of tracing per dozen layers.
MAX_LAYERS = 48
#: Most tokens ``demo --tokens`` generates.
MAX_TOKENS = 256


def _bounded_int(name: str, low: int, high: int):
    """An argparse type: an int in ``[low, high]``, else a clear argparse error naming ``name``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m moe_fx`` and the ``moe-fx`` script."""
    from moe_fx.testing.families import TEXT_MOE_FAMILIES

    parser = argparse.ArgumentParser(prog="python -m moe_fx", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    layers = _bounded_int("--layers", 1, MAX_LAYERS)
    p = sub.add_parser("demo", help="compile a tiny MoE LM with moe_fx and compare with eager")
    p.add_argument("--layers", type=layers, default=2, help=f"decoder layers, 1 to {MAX_LAYERS} (default 2)")
    p.add_argument("--tokens", type=_bounded_int("--tokens", 1, MAX_TOKENS), default=16,
                   help=f"tokens to generate, 1 to {MAX_TOKENS} (default 16)")
    p.add_argument("--impl", default="grouped_mm", choices=IMPLS, help=IMPL_HELP)
    p.set_defaults(fn=demo)
    p = sub.add_parser("explain", help="print the explain report for a tiny model")
    p.add_argument("--family", default="qwen3_moe", choices=TEXT_MOE_FAMILIES, metavar="FAMILY",
                   help="a transformers MoE family (model_type), default qwen3_moe; one of: "
                        + ", ".join(TEXT_MOE_FAMILIES))
    p.add_argument("--impl", default="grouped_mm", choices=[*IMPLS, "eager"],
                   help=IMPL_HELP + "; eager: transformers' loop over the experts hit (captured at module level)")
    p.add_argument("--layers", type=layers, default=2, help=f"decoder layers, 1 to {MAX_LAYERS} (default 2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the tiny model's weights and activations (default float32)")
    p.add_argument("--dynamic", action="store_true",
                   help="trace for any token count, as moe_fx.compile(..., dynamic=True) does")
    p.set_defaults(fn=explain_cmd)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
