"""Migrating a project: the entry script and the local modules it imports, together.

The entry script gets the torchrun entry point; the modules where the model is built,
the loaders are made and the loop runs get their edits where those things live. One
report lists the changes per file; the files are written all together or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from ddpify.analysis.loader_classes import chosen_loader_modules
from ddpify.analysis.project import Project
from ddpify.analysis.tree import Tree
from ddpify.engine import mentions_torch
from ddpify.files import SourceFile
from ddpify.libcst_speed import parse_module
from ddpify.migrate.analyze import Options, computed_imports
from ddpify.migrate.pipeline import migrate_sources
from ddpify.migrate.report import MigrationResult


@dataclass
class ProjectMigration:
    project: Project
    # One result per migrated module, the entry first; paths as the user gave the entry.
    results: list[MigrationResult]
    sources: dict[str, SourceFile]

    @property
    def entry(self) -> MigrationResult:
        return self.results[0]

    @property
    def migrated(self) -> bool:
        return self.entry.migrated

    @property
    def changed(self) -> bool:
        return any(result.changed for result in self.results)

    @property
    def changed_results(self) -> list[MigrationResult]:
        return [result for result in self.results if result.changed]

    def summary(self) -> MigrationResult:
        """The numbers that describe the whole run (batch policy, LR, AMP), for verify."""
        entry = self.entry
        for result in self.results:
            if result.lr_scaling != "none":
                entry.lr_scaling, entry.lr_rule = result.lr_scaling, result.lr_rule
            entry.hand_made = entry.hand_made or result.hand_made
            entry.replicated = entry.replicated or result.replicated
            if result.amp != entry.amp and result.amp not in ("off", "unchanged"):
                entry.amp = result.amp
        return entry

    def render(self, stream: TextIO, script: str | None = None) -> None:
        write = stream.write
        entry = self.summary()
        if not self.migrated:
            entry.render(stream, script)
            self._render_computed_imports(stream)
            return
        # A module with nothing to change may still hold something a human must do.
        others = [r for r in self.results[1:] if r.changed or r.needs_human]
        files = len(self.changed_results)
        write(
            f"{entry.filename}: project of {len(self.project.modules)} local modules; "
            f"{files} file{'s' if files != 1 else ''} to change\n"
        )
        entry.render(stream, script)
        for result in others:
            unchanged = "" if result.changed else " (unchanged)"
            write(f"\n{result.filename}: imported by {entry.filename}{unchanged}\n")
            result.render_changes(stream)
        for path, what, why in self.project.problems:
            write(f"\nnot followed: `{what}` in {self.project.relative(path)}: {why}\n")
        if self.project.truncated:
            write("\nnot followed: more local modules than ddpify reads in one project\n")
        self._render_computed_imports(stream)

    def _render_computed_imports(self, stream: TextIO) -> None:
        """Which modules a name computed at run time was taken to import, and why."""
        for found in self.project.computed:
            if not found.chosen:
                continue
            where = self.project.relative(found.importer)
            chosen = ", ".join(self.project.relative(path) for path in found.chosen)
            stream.write(
                f"\nfollowed `{found.written}` ({where}:{found.line}) to {chosen}: {found.why}"
            )
            others = [path for path in found.candidates if path not in found.chosen]
            if others:
                shown = ", ".join(self.project.relative(path) for path in others)
                stream.write(
                    f"; a run that picks another module ({shown}) runs code ddpify did not migrate"
                )
            stream.write("\n")


def load_project(entry: str | Path) -> Project:
    """The entry and the local modules it imports (SourceError if the entry is unreadable)."""
    return Project.discover([entry])


def migrate_project(
    project: Project, entry_name: str, options: Options | None = None
) -> ProjectMigration:
    """Migrate every module of `project` that uses torch (GateError names the module that
    fails a gate; nothing is written here)."""
    entry_path = project.entries[0]
    names: dict[str, Path] = {}
    sources: dict[str, SourceFile] = {}
    for path, module in project.modules.items():
        if path != entry_path and not mentions_torch(module.text):
            continue
        name = entry_name if path == entry_path else _shown(path, entry_path, entry_name)
        names[name] = path
        sources[name] = module.source
    loader_modules = chosen_loader_modules(project)
    if loader_modules:
        options = replace(options or Options(), loader_modules=loader_modules)
    results = migrate_sources({name: s.text for name, s in sources.items()}, options)
    _name_computed_imports(project, results)
    return ProjectMigration(project, results, sources)


def _name_computed_imports(project: Project, results: list) -> None:
    """A refusal for want of a training step names the run-time imports (`importlib.
    import_module(...)`) of every module, those without torch too (a model registry's
    `models/__init__.py`), where the search for the step stopped."""
    entry = results[0]
    if entry.migrated or not (entry.reason or "").startswith("no training step"):
        return
    trees = [
        Tree(parse_module(module.text))
        for module in project.modules.values()
        if "import_module" in module.text
    ]
    followed = {found.written for found in project.computed if found.chosen}
    extra = computed_imports(trees, followed)
    base = entry.reason.split(";", 1)[0]  # analyze named only the modules with torch
    for result in results:
        result.reason = base + extra


def _shown(path: Path, entry_path: Path, entry_name: str) -> str:
    """A module's path as the user would type it: beside the entry as they named it."""
    base = Path(entry_name).parent
    try:
        return str(base / path.relative_to(entry_path.parent))
    except ValueError:
        return str(path)
