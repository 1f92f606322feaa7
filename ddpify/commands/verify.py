from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ddpify.files import SourceError, read_source

EXAMPLES = """\
examples:
  ddpify verify train.py train_ddp.py                 2 processes, 3 optimizer steps
  ddpify verify train.py train_ddp.py --nproc 4 --steps 5
  ddpify verify train.py train_ddp.py -- --epochs 1 --data ./tiny
  ddpify verify train.py train_ddp.py --batch-policy global --output-format json

The original runs as one process, the converted script under torchrun (gloo on CPU, nccl when
there is a GPU per process); a probe records the gradients of every optimizer step and stops
both after --steps steps. Arguments after `--` go to both scripts.

batch policy: per-rank = each process keeps the original batch size (the original is run at
N times its batch; the LR may be scaled by N or sqrt(N)); global = each process gets batch // N
and the same LR. Default: what the converted script's `# ddpify: ...` comments say, else
inferred from its batch size.

When the migration fixed a bug that changes the numbers (scaler.unscale_ before clipping,
DDP044; sampler.set_epoch, DDP022), the original runs with ddpify's own fix for it applied, on
a temporary copy, and the notes say so; --no-fix-original compares with the original as it is.

exit status: 0 match, 1 mismatch, 2 could not run or inconclusive.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="run a script and its DDP conversion, compare gradients step by step",
        description="Run ORIGINAL on one process and CONVERTED on N under torchrun, and "
        "compare gradients at every optimizer step and the weights after the last.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] ORIGINAL CONVERTED [-- SCRIPT_ARGS ...]",
    )
    parser.add_argument("original", type=Path, help="the single-process script")
    parser.add_argument("converted", type=Path, help="its DDP version")
    parser.add_argument("--nproc", type=positive_int, default=2, help="processes for CONVERTED (2)")
    parser.add_argument(
        "--steps", type=positive_int, default=3, help="optimizer steps to compare (3)"
    )
    parser.add_argument(
        "--rtol", type=non_negative, help="relative tolerance (default: the dtype's)"
    )
    parser.add_argument(
        "--atol", type=non_negative, help="absolute tolerance (default: the dtype's)"
    )
    parser.add_argument(
        "--batch-policy",
        choices=["per-rank", "global", "auto"],
        help="how the conversion split the batch (default: from the markers)",
    )
    parser.add_argument(
        "--lr-scale",
        type=positive,
        help="the converted LR divided by the original's (default: markers, else 1, N or sqrt(N))",
    )
    parser.add_argument(
        "--timeout", type=positive, default=300.0, help="seconds allowed for each run (300)"
    )
    parser.add_argument(
        "--no-fix-original",
        action="store_true",
        help="run the original as it is, without the number-changing fixes the migration made",
    )
    parser.add_argument("--output-format", choices=["full", "json"], default="full")
    parser.set_defaults(run=run, script_args=[])
    parser.parse_known_args = split_script_args(parser.parse_known_args)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def unreadable_input(path: Path) -> str | None:
    """Why a script cannot be verified before anything runs: unreadable, undecodable, or
    not valid Python (compiled, never executed). None when it can be run."""
    try:
        source = read_source(path)
        compile(source.text, str(path), "exec", dont_inherit=True)
    except SourceError as exc:
        return f"{path}: {exc}"
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        return f"{where}: not valid Python: {exc.msg}"
    except (ValueError, OverflowError, RecursionError, MemoryError) as exc:
        return f"{path}: cannot be compiled: {exc}"
    return None


def split_script_args(parse_known_args):
    """Everything after the first `--` goes to the scripts, wherever the options stand.

    (argparse alone matches positionals once: `a.py b.py --steps 2 -- --epochs 1` would fail.)
    """

    def parse(args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        tail = []
        if "--" in args:
            cut = args.index("--")
            args, tail = args[:cut], args[cut + 1 :]
        namespace, extras = parse_known_args(args, namespace)
        namespace.script_args = tail
        return namespace, extras

    return parse


def run(args: argparse.Namespace) -> int:
    for path in (args.original, args.converted):
        problem = unreadable_input(path)
        if problem:
            print(f"ddpify: error: {problem}; nothing was run", file=sys.stderr)
            return 2
    from ddpify.verify import run_verify
    from ddpify.verify.markers import read_markers

    batch_policy, lr_scale = args.batch_policy, args.lr_scale
    markers = None
    if batch_policy is None or lr_scale is None:
        try:
            markers = read_markers(args.converted.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            markers = None
    if markers is not None:
        batch_policy = batch_policy or markers.batch_policy
        if lr_scale is None:
            lr_scale = markers.lr_scale(args.nproc)
    result = run_verify(
        args.original,
        args.converted,
        nproc=args.nproc,
        steps=args.steps,
        script_args=args.script_args,
        batch_policy=batch_policy or "auto",
        lr_scale=lr_scale,
        rtol=args.rtol,
        atol=args.atol,
        timeout=args.timeout,
        fixed_codes=() if args.no_fix_original else None,
    )
    if markers is not None and markers.lines:
        result.notes.append("migration markers read: " + " | ".join(markers.lines))
    result.render(sys.stdout, args.output_format)
    return result.exit_code
