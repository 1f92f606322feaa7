"""`ddpify migrate`: rewrite a training script for DDP under torchrun, and report."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from pathlib import Path

from ddpify.analysis.project import Project, copy_python_files
from ddpify.config import ConfigError, MigrateConfig, load_config
from ddpify.files import SourceError, read_source, write_file, write_files
from ddpify.gates import GateError
from ddpify.migrate import MigrationResult, Options, migrate_source
from ddpify.migrate.project import ProjectMigration, load_project, migrate_project

EXIT_OK, EXIT_NOT_MIGRATED, EXIT_ERROR = 0, 1, 2

EXAMPLES = """\
examples:
  ddpify migrate train.py                      rewrite in place, print the report
  ddpify migrate train.py -o train_ddp.py      write the result elsewhere
  ddpify migrate train.py --diff               show the diff, write nothing
  ddpify migrate train.py --batch-policy global --amp off
  ddpify migrate train.py --verify -- --epochs 1   only write if gradients match
  ddpify migrate projects/detector/             the one entry script in a directory

projects: when SCRIPT imports local modules (`from trainer import Trainer`, a package
beside it), every module that needs a change is rewritten where the model, loaders and
loop live, with one report; all files are written or none.

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
    parser.add_argument(
        "script", help="the training script (its local imports come along), or a directory"
    )
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
    if os.path.isdir(args.script):
        entry = _entry_in(args.script)
        if entry is None:
            return EXIT_ERROR
        args.script = entry
    options = _options(args, defaults)
    try:
        project = load_project(args.script)
    except SourceError as exc:
        print(f"ddpify: error: {args.script}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if not project.is_single_file:
        return _run_project(args, project, options, script_args)
    source = project.modules[project.entries[0]].source
    try:
        result = migrate_source(source.text, args.script, options)
    except GateError as exc:
        return _gate_failed(args.script, exc)
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


def _entry_in(directory: str) -> str | None:
    """The one script of `directory` that starts a run (a `__main__` guard), else None
    with the error said."""
    candidates = sorted(str(path) for path in Path(directory).glob("*.py") if _starts_a_run(path))
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        print(
            f"ddpify: error: {directory}: no entry script (a .py file with an "
            '`if __name__ == "__main__":` block) in this directory; name the script',
            file=sys.stderr,
        )
    else:
        shown = ", ".join(Path(c).name for c in candidates)
        print(
            f"ddpify: error: {directory}: several entry scripts ({shown}); name the one to migrate",
            file=sys.stderr,
        )
    return None


def _starts_a_run(path: Path) -> bool:
    try:
        text = read_source(path).text
    except SourceError:
        return False
    return "__main__" in text and "torch" in text


def _run_project(args, project: Project, options: Options, script_args) -> int:
    """Migrate the entry script and the local modules it imports; write all or none."""
    if args.output:
        print(
            f"ddpify: error: {args.script} imports local modules that change too; -o/--output "
            "takes a single script: migrate in place (your version control keeps the original), "
            "or copy the project first",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        migration = migrate_project(project, args.script, options)
    except GateError as exc:
        return _gate_failed(args.script, exc)
    report = sys.stderr if args.diff else sys.stdout
    if not migration.migrated:
        migration.render(report)
        return EXIT_NOT_MIGRATED
    if args.check:
        migration.render(report)
        return EXIT_NOT_MIGRATED if migration.changed else EXIT_OK
    if args.diff:
        for result in migration.changed_results:
            sys.stdout.writelines(_diff(result, result.filename))
        migration.render(report)
        return EXIT_OK
    if getattr(args, "verify", False) and migration.changed:
        code = _verify_project(migration, script_args)
        if code != EXIT_OK:
            return code
    try:
        write_files(
            [
                (source.path, source.encode(result.output), source.data)
                for result in migration.changed_results
                for source in [migration.sources[result.filename]]
            ],
            force=args.force_write,
        )
    except SourceError as exc:
        print(f"ddpify: error: {exc}; nothing was written", file=sys.stderr)
        return EXIT_ERROR
    migration.render(report)
    return EXIT_OK


def _gate_failed(script: str, exc: GateError) -> int:
    if exc.pass_name == "parse":
        print(f"ddpify: error: {script}: {exc.reason}", file=sys.stderr)
    else:
        print(
            f"ddpify: error: the {exc.pass_name} pass failed a safety gate: {exc.reason}; "
            "nothing was written (please report this)",
            file=sys.stderr,
        )
    return EXIT_ERROR


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


def _verify_project(migration: ProjectMigration, script_args) -> int:
    """Verify a project before writing it: the converted modules go into a temporary copy
    of the project's Python files, whose entry script runs against the original."""
    from ddpify.verify import run_verify

    entry = migration.project.entries[0]
    root = migration.project.root
    summary = migration.summary()
    with tempfile.TemporaryDirectory(prefix="ddpify-project-") as work:
        copy = copy_python_files(root, Path(work))
        for result in migration.changed_results:
            path = Path(migration.sources[result.filename].path)
            (copy / path.relative_to(root)).write_text(result.output, encoding="utf-8")
        converted = copy / entry.relative_to(root)
        nproc = 2
        outcome = run_verify(
            entry,
            converted,
            nproc=nproc,
            script_args=tuple(script_args),
            batch_policy=summary.batch_policy,
            lr_scale=summary.lr_scale_for(nproc),
            fixed_codes=sorted({c for r in migration.results for c in r.fixed_codes}),
        )
        outcome.settings["converted"] = f"the migration of {entry} (not yet written)"
    outcome.render(sys.stdout)
    if outcome.exit_code != 0:
        print("ddpify: verification did not pass; nothing was written", file=sys.stderr)
        return EXIT_NOT_MIGRATED if outcome.exit_code == 1 else EXIT_ERROR
    return EXIT_OK
