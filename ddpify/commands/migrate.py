"""`ddpify migrate`: rewrite a training script for DDP under torchrun, and report."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from ddpify.config import ConfigError, MigrateConfig, load_config
from ddpify.files import SourceError, read_source, write_file
from ddpify.gates import GateError
from ddpify.migrate import MigrationResult, Options, migrate_source

EXIT_OK, EXIT_NOT_MIGRATED, EXIT_ERROR = 0, 1, 2

EXAMPLES = """\
examples:
  ddpify migrate train.py                      rewrite in place, print the report
  ddpify migrate train.py -o train_ddp.py      write the result elsewhere
  ddpify migrate train.py --diff               show the diff, write nothing
  ddpify migrate train.py --batch-policy global --amp off
  ddpify migrate train.py --verify -- --epochs 1   only write if gradients match

batch policy:
  per-rank  each process keeps the original batch size; the global batch grows N-fold and
            the learning rate is scaled (linear for SGD, square root for Adam-like)
  global    each process takes batch // N; the learning rate is unchanged (same math)

exit codes: 0 migrated (or nothing to change), 1 not migrated (reason given) or, with
--check, would change, or --verify found a mismatch; 2 usage, input or internal error.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="rewrite a single-GPU / DataParallel / hand-launched DDP script for torchrun",
        description=(
            "Rewrite a training script to DistributedDataParallel under torchrun: process "
            "group from the environment, local-rank devices, DDP wrap, DistributedSampler with "
            "set_epoch, AMP, rank-0 I/O. The result also runs as a plain `python` process."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", help="the training script")
    _add_options(parser)
    # Everything after SCRIPT: more options, then `--` and the script's own arguments.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="write here instead of rewriting SCRIPT in place")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--diff", action="store_true", help="print a unified diff, write nothing")
    mode.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the script would change"
    )
    # Defaults are None so that [tool.ddpify.migrate] can fill what the flags leave out.
    parser.add_argument(
        "--batch-policy",
        choices=["per-rank", "global"],
        help="per-rank (default): keep the batch per process, scale the LR; "
        "global: batch // N per process, LR unchanged",
    )
    parser.add_argument(
        "--lr-scaling",
        choices=["auto", "linear", "sqrt", "none"],
        help="the LR rule (default auto: linear for SGD, sqrt for Adam-like)",
    )
    parser.add_argument(
        "--amp",
        choices=["auto", "bf16", "fp16", "off"],
        help="mixed precision on GPUs (default auto: bf16 where supported, else fp16)",
    )
    parser.add_argument(
        "--no-sync-bn",
        dest="sync_bn",
        action="store_const",
        const=False,
        help="do not convert BatchNorm to SyncBatchNorm",
    )
    parser.add_argument(
        "--force-write",
        action="store_true",
        help="also rewrite a read-only script or one owned by another user",
    )
    settings = parser.add_mutually_exclusive_group()
    settings.add_argument("--config", metavar="PATH", help="use this pyproject.toml/ddpify.toml")
    settings.add_argument("--isolated", action="store_true", help="ignore every configuration file")
    if _verify_available():
        parser.add_argument(
            "--verify",
            action="store_true",
            help="run the original and the result (2 processes, CPU) and write only if the "
            "gradients match; the script's own arguments follow `--`",
        )


def _split_rest(args: argparse.Namespace) -> list[str]:
    """Options given after SCRIPT are parsed here; what follows `--` goes to the script."""
    rest = list(args.rest)
    if "--" in rest:
        index = rest.index("--")
        options, script_args = rest[:index], rest[index + 1 :]
    else:
        options, script_args = rest, []
    if options:
        late = argparse.ArgumentParser(prog="ddpify migrate SCRIPT", add_help=False)
        _add_options(late)
        defaults = vars(late.parse_args([]))
        given, unknown = late.parse_known_args(options)
        for key, value in vars(given).items():
            if value != defaults[key]:  # given after SCRIPT: wins over the default
                setattr(args, key, value)
        script_args = unknown + script_args  # argparse may have eaten the `--` already
    return script_args


def _verify_available() -> bool:
    try:
        from ddpify.verify import run_verify  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    script_args = _split_rest(args)
    verify = getattr(args, "verify", False)
    if script_args and not verify:
        print(
            "ddpify: error: script arguments (after `--`) are only used with --verify",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if args.script.endswith(".ipynb"):
        print(
            f"ddpify: error: {args.script}: migrate takes Python scripts; export the notebook "
            "first (jupyter nbconvert --to script)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        defaults = load_config(args.config, start=args.script, isolated=args.isolated).migrate
    except ConfigError as exc:
        print(f"ddpify: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        source = read_source(args.script)
    except SourceError as exc:
        print(f"ddpify: error: {args.script}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    options = _options(args, defaults)
    try:
        result = migrate_source(source.text, args.script, options)
    except GateError as exc:
        if exc.pass_name == "parse":
            print(f"ddpify: error: {args.script}: {exc.reason}", file=sys.stderr)
        else:
            print(
                f"ddpify: error: the {exc.pass_name} pass failed a safety gate: {exc.reason}; "
                "nothing was written (please report this)",
                file=sys.stderr,
            )
        return EXIT_ERROR
    report = sys.stderr if args.diff else sys.stdout
    if not result.migrated:
        result.render(report)
        return EXIT_NOT_MIGRATED
    target = Path(args.output or args.script)
    if args.check:
        result.render(report, str(target))
        return EXIT_NOT_MIGRATED if result.changed else EXIT_OK
    if args.diff:
        sys.stdout.writelines(_diff(result, args.script))
        result.render(report, str(target))
        return EXIT_OK
    if verify and result.changed:
        code = _verify(result, Path(args.script), target, script_args)
        if code != EXIT_OK:
            return code
    if result.changed or args.output:
        in_place = _same_file(target, Path(args.script))
        try:
            data = source.encode(result.output)
            write_file(
                target, data, expected=source.data if in_place else None, force=args.force_write
            )
        except SourceError as exc:
            print(f"ddpify: error: {target}: {exc}", file=sys.stderr)
            return EXIT_ERROR
    result.render(report, str(target))
    return EXIT_OK


def _options(args: argparse.Namespace, defaults: MigrateConfig) -> Options:
    """Command-line flags win over [tool.ddpify.migrate], which wins over the defaults."""

    def pick(flag, configured, default):
        return flag if flag is not None else configured if configured is not None else default

    lr_scaling = pick(args.lr_scaling, defaults.lr_scaling, "auto")
    return Options(
        pick(args.batch_policy, defaults.batch_policy, "per-rank"),
        None if lr_scaling == "auto" else lr_scaling,  # None: chosen by optimizer
        pick(args.amp, defaults.amp, "auto"),
        pick(args.sync_bn, defaults.sync_bn, True),
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _diff(result: MigrationResult, path: str) -> list[str]:
    return list(
        difflib.unified_diff(
            result.original.splitlines(keepends=True),
            result.output.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
        )
    )


def _verify(result: MigrationResult, original: Path, target: Path, script_args) -> int:
    from ddpify.verify import run_verify

    nproc = 2
    outcome = run_verify(
        original,
        target,
        nproc=nproc,
        script_args=tuple(script_args),
        batch_policy=result.batch_policy,
        lr_scale=result.lr_scale_for(nproc),
        converted_source=result.output,
        fixed_codes=sorted(result.fixed_codes),
    )
    if _same_file(target, original):
        # In place: the file on disk is still the original; name the other side for what it is.
        outcome.settings["converted"] = f"the migration of {original} (not yet written)"
    outcome.render(sys.stdout)
    if outcome.exit_code != 0:
        print(f"ddpify: verification did not pass; {target} was not written", file=sys.stderr)
        return EXIT_NOT_MIGRATED if outcome.exit_code == 1 else EXIT_ERROR
    return EXIT_OK
