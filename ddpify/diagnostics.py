"""The result objects every consumer (CLI renderers, LSP, migrate) shares."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 2, "warning": 1, "info": 0}[self.value]


class Applicability(str, enum.Enum):
    """Whether a fix may be applied without review (ruff's safe/unsafe split)."""

    SAFE = "safe"
    UNSAFE = "unsafe"


class FixAvailability(str, enum.Enum):
    NEVER = "never"
    SOMETIMES = "sometimes"
    ALWAYS = "always"


@dataclass(frozen=True, order=True)
class Location:
    """1-based row and 1-based column, as editors and ruff show them."""

    row: int
    column: int


@dataclass(frozen=True)
class Edit:
    """Replace the text between two locations with `content`."""

    content: str
    location: Location
    end_location: Location


@dataclass(frozen=True)
class Fix:
    message: str
    applicability: Applicability
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Diagnostic:
    code: str
    name: str
    severity: Severity
    message: str
    filename: str
    location: Location
    end_location: Location
    fix: Fix | None = None
    # The offending physical lines, for renderers that show source context.
    source_lines: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # In a notebook, the 1-based cell the finding is in; rows then count within the cell.
    cell: int | None = None

    @property
    def position(self) -> str:
        """`row:column`, or `cell N:row:column` in a notebook (as ruff writes them)."""
        where = f"{self.location.row}:{self.location.column}"
        return f"cell {self.cell}:{where}" if self.cell is not None else where

    @property
    def fails(self) -> bool:
        """Warnings and errors fail a check run; info findings are advisory."""
        return self.severity is not Severity.INFO
