"""Configuration: `[tool.ddpify]` in the nearest pyproject.toml, or a ddpify.toml.

In `ddpify.toml` the settings sit at the top level (as in ruff.toml), with the migrate
defaults under `[migrate]`. Keys use dashes, as ruff's do:

    [tool.ddpify]
    select = ["DDP0"]
    ignore = ["DDP041"]
    per-file-ignores = { "tests/*" = ["DDP05"] }
    extend-exclude = ["third_party"]
    unsafe-fixes = false

    [tool.ddpify.migrate]
    batch-policy = "global"
    amp = "off"

Any unknown key or badly typed value is a ConfigError naming the key and the file.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpify.diagnostics import Diagnostic
from ddpify.rules import UnknownRuleError, select_rules, validate_selectors
from ddpify.rules.base import Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.9 and 3.10 only
    import tomli as tomllib

CONFIG_FILES = ("ddpify.toml", "pyproject.toml")

# The accepted values of each [tool.ddpify.migrate] key; None means "a boolean".
MIGRATE_CHOICES: dict[str, tuple[str, ...] | None] = {
    "batch-policy": ("per-rank", "global"),
    "lr-scaling": ("auto", "linear", "sqrt", "none"),
    "amp": ("auto", "bf16", "fp16", "off"),
    "sync-bn": None,
}


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class MigrateConfig:
    """Defaults for `ddpify migrate`; None means "not set here", so the command's own
    default (or its command-line flag) applies."""

    batch_policy: str | None = None
    lr_scaling: str | None = None
    amp: str | None = None
    sync_bn: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """Only the keys the file set, under their TOML names."""
        values = {
            "batch-policy": self.batch_policy,
            "lr-scaling": self.lr_scaling,
            "amp": self.amp,
            "sync-bn": self.sync_bn,
        }
        return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class Config:
    select: list[str] | None = None
    ignore: list[str] = field(default_factory=list)
    extend_select: list[str] = field(default_factory=list)
    per_file_ignores: dict[str, list[str]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    extend_exclude: list[str] = field(default_factory=list)
    unsafe_fixes: bool | None = None
    migrate: MigrateConfig = field(default_factory=MigrateConfig)
    # The file these settings came from (None: defaults) and the directory that
    # relative patterns are anchored to.
    path: Path | None = None
    root: Path = field(default_factory=Path.cwd)

    def rules(
        self,
        select: Sequence[str] | None = None,
        ignore: Sequence[str] = (),
        extend_select: Sequence[str] = (),
    ) -> list[type[Rule]]:
        """The enabled rules: command-line selectors override the file's `select`, and
        add to its `ignore` and `extend-select`."""
        return select_rules(
            select if select is not None else self.select,
            [*self.ignore, *ignore],
            [*self.extend_select, *extend_select],
        )

    def _relative(self, path: str | Path) -> str:
        absolute = Path(path).absolute()
        try:
            return absolute.relative_to(self.root.absolute()).as_posix()
        except ValueError:
            return absolute.as_posix()

    def ignored_codes(self, path: str | Path) -> list[str]:
        """The per-file-ignores selectors whose pattern matches `path`."""
        relative = self._relative(path)
        return [
            code
            for pattern, codes in self.per_file_ignores.items()
            if _matches(relative, pattern)
            for code in codes
        ]

    def filter(self, diagnostics: Iterable[Diagnostic], path: str | Path) -> list[Diagnostic]:
        ignored = self.ignored_codes(path)
        if not ignored:
            return list(diagnostics)
        return [
            d
            for d in diagnostics
            if not any(sel == "ALL" or d.code.startswith(sel) for sel in ignored)
        ]

    @property
    def exclude_patterns(self) -> list[str]:
        return [*self.exclude, *self.extend_exclude]

    def is_excluded(self, path: str | Path) -> bool:
        relative = self._relative(path)
        return any(_matches(relative, pattern) for pattern in self.exclude_patterns)


def _matches(relative: str, pattern: str) -> bool:
    """gitignore-like: a pattern without a slash matches any path component; one with a
    slash is anchored at the config's directory. A match on a directory covers its files."""
    pattern = pattern.strip().rstrip("/")
    if pattern.startswith("./"):
        pattern = pattern[2:]
    parts = relative.split("/")
    if "/" not in pattern:
        return any(fnmatch.fnmatchcase(part, pattern) for part in parts)
    pattern = pattern.lstrip("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes)


def find_config(start: str | Path) -> Path | None:
    """The nearest ddpify.toml, or pyproject.toml with a [tool.ddpify] table, at or above
    `start` (a file or a directory)."""
    directory = Path(start).absolute()
    if not os.path.isdir(directory):
        directory = directory.parent
    for candidate_dir in (directory, *directory.parents):
        for name in CONFIG_FILES:
            candidate = candidate_dir / name
            if os.path.isfile(candidate) and (
                name != "pyproject.toml" or _has_tool_table(candidate)
            ):
                return candidate
    return None


def _has_tool_table(pyproject: Path) -> bool:
    try:
        data = _read_toml(pyproject)
    except ConfigError:
        # A broken pyproject.toml that mentions us is still ours to complain about.
        try:
            return "[tool.ddpify" in pyproject.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
    return _tool_table(data) is not None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 (byte {exc.start}); TOML files must be UTF-8"
        ) from None


def _tool_table(data: dict[str, Any]) -> Any:
    """`[tool.ddpify]`, or None; a `tool` that is not a table has no such key."""
    tool = data.get("tool", {})
    return tool.get("ddpify") if isinstance(tool, dict) else None


def load_config(
    path: str | Path | None = None,
    *,
    start: str | Path | None = None,
    isolated: bool = False,
) -> Config:
    """Settings from `path`, else from the nearest config file above `start` (default:
    the working directory); `isolated` ignores every file and returns the defaults."""
    if isolated:
        return Config()
    if path is None:
        path = find_config(start if start is not None else Path.cwd())
        if path is None:
            return Config()
    path = Path(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such configuration file")
    data = _read_toml(path)
    if path.name == "pyproject.toml":
        table = _tool_table(data)
        table = {} if table is None else table
        prefix = "tool.ddpify"
    else:
        table, prefix = data, ""
    return _parse(table, prefix, path)


def _key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _parse(table: Any, prefix: str, path: Path) -> Config:
    reader = _Reader(path, prefix)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{prefix}] must be a table")
    known = {
        "select",
        "ignore",
        "extend-select",
        "per-file-ignores",
        "exclude",
        "extend-exclude",
        "unsafe-fixes",
        "migrate",
    }
    reader.reject_unknown(table, known)
    per_file = reader.table(table, "per-file-ignores")
    per_file_ignores = {
        pattern: reader.codes(per_file, pattern, f"per-file-ignores.{pattern!r}")
        for pattern in per_file
    }
    return Config(
        select=reader.codes(table, "select") if "select" in table else None,
        ignore=reader.codes(table, "ignore"),
        extend_select=reader.codes(table, "extend-select"),
        per_file_ignores=per_file_ignores,
        exclude=reader.strings(table, "exclude"),
        extend_exclude=reader.strings(table, "extend-exclude"),
        unsafe_fixes=reader.boolean(table, "unsafe-fixes"),
        migrate=_parse_migrate(reader, table),
        path=path,
        root=path.parent,
    )


def _parse_migrate(reader: _Reader, table: dict[str, Any]) -> MigrateConfig:
    migrate = reader.table(table, "migrate")
    sub = _Reader(reader.path, _key(reader.prefix, "migrate"))
    sub.reject_unknown(migrate, set(MIGRATE_CHOICES))
    values: dict[str, Any] = {}
    for key, choices in MIGRATE_CHOICES.items():
        attribute = key.replace("-", "_")
        if choices is None:
            values[attribute] = sub.boolean(migrate, key)
        else:
            values[attribute] = sub.choice(migrate, key, choices)
    return MigrateConfig(**values)


@dataclass
class _Reader:
    """Typed access to one table, with errors that say which key of which file."""

    path: Path
    prefix: str

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: `{_key(self.prefix, key)}` {problem}")

    def reject_unknown(self, table: dict[str, Any], known: set[str]) -> None:
        for key in table:
            if key not in known:
                hint = ""
                underscored = key.replace("_", "-")
                if underscored in known:
                    hint = f" (did you mean `{underscored}`?)"
                elif key == "tool" and self.path.name != "pyproject.toml":
                    hint = f" (in {self.path.name} the settings sit at the top level)"
                raise self.fail(
                    key, f"is not a known setting{hint}; known: {', '.join(sorted(known))}"
                )

    def table(self, table: dict[str, Any], key: str) -> dict[str, Any]:
        value = table.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a table, not {type(value).__name__}")
        return value

    def strings(self, table: dict[str, Any], key: str, shown: str | None = None) -> list[str]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(shown or key, "must be a list of strings")
        return list(value)

    def codes(self, table: dict[str, Any], key: str, shown: str | None = None) -> list[str]:
        codes = [code.strip().upper() for code in self.strings(table, key, shown)]
        try:
            validate_selectors(codes)
        except UnknownRuleError as exc:
            raise self.fail(shown or key, f"has an {exc}") from None
        return codes

    def boolean(self, table: dict[str, Any], key: str) -> bool | None:
        value = table.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, not {value!r}")
        return value

    def choice(self, table: dict[str, Any], key: str, choices: tuple[str, ...]) -> str | None:
        value = table.get(key)
        if value is not None and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value
