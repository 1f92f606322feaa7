"""Running analysis on hostile input without letting one file take the run down.

libcst's native parser recurses once per level of nesting and is quadratic on long
operator chains: a 3 KB file of 1,500 nested parentheses crashes the interpreter
(SIGSEGV), a 2,000-term sum takes 15 s to parse, and libcst's code generation and
position tracking recurse in Python once per level, so a 500-term expression raised
RecursionError. Two defences, used by check, --fix, migrate and the language server:

- `deep` runs the work in a thread with a large stack and a raised recursion limit, so
  any depth that CPython's own compiler accepts (about 2,000 levels) is plain work;
- `guarded` sends a file whose shape could still crash or stall the parser (deep
  brackets, very long operator chains: `risky`) to a forked child with a time limit, so a
  crash or a stall costs that one file, named, never the run.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import signal
import sys
import threading
import warnings
from typing import Any, Callable, TypeVar

T = TypeVar("T")

STACK_BYTES = 512 * 1024 * 1024  # reserved address space; pages are only touched when used
RECURSION_LIMIT = 100_000
# Work on a text of at least this many characters (about 10k lines) is worth a forked
# child beside it (`Beside`); below it the fork costs more than the work it moves.
PARALLEL_CHARS = 300_000
# Seconds one isolated file may take (check, fix or migrate of that file).
FILE_TIMEOUT = 60.0

# Shapes below these bounds parse in milliseconds and cannot overflow the parser's stack.
MAX_SAFE_DEPTH = 40  # brackets open at once
MAX_SAFE_CHAIN = 400  # operators and dots in one logical line

_SCAN = re.compile(r"[(\[{]|[)\]}]|\n|[-+*/%&|^<>@.~]|\b(?:and|or|not|if|lambda)\b")

_local = threading.local()
_limit_lock = threading.Lock()
_deep_threads = 0
_saved_limit = 0


class GaveUp(Exception):
    """The input stopped the work (the parser crashed, or the time limit passed)."""


# The last text scanned and the answer: `guarded` and then the engine's parse ask about
# the same string (the language server's round trip scans each edit's text once).
_last_scan: tuple[str, bool] | None = None


def risky(text: str) -> bool:
    """Whether `text` nests brackets deeply or chains very many operators in one line.

    A rough scan (brackets inside strings count too): it only decides where the work
    runs, so a false alarm costs a process start, never a finding.
    """
    global _last_scan
    last = _last_scan
    if last is not None and last[0] is text:
        return last[1]
    found = _scan(text)
    _last_scan = (text, found)
    return found


def _scan(text: str) -> bool:
    depth = chain = 0
    for match in _SCAN.finditer(text):
        char = match.group()[0]
        if char in "([{":
            depth += 1
            if depth > MAX_SAFE_DEPTH:
                return True
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif char == "\n":
            if depth == 0:
                chain = 0
        else:
            chain += 1
            if chain > MAX_SAFE_CHAIN:
                return True
    return False


def python_rejects(text: str, filename: str, *, whole: bool = False) -> SyntaxError | None:
    """CPython's own verdict, from its C parser, which bounds nesting instead of crashing.
    `whole`: the compiler's later checks too (`return` outside a function, a nonlocal
    with no binding), which a parse alone lets through."""
    try:
        with warnings.catch_warnings():  # the script's own SyntaxWarnings are not our output
            warnings.simplefilter("ignore")
            compile(text, filename, "exec", 0 if whole else 1024, dont_inherit=True)  # 1024: AST
    except SyntaxError as exc:
        return exc
    except (RecursionError, MemoryError):
        return SyntaxError("too deeply nested for Python's own compiler")
    except ValueError as exc:  # null bytes
        return SyntaxError(str(exc))
    return None


def inside() -> bool:
    """True in work already started by `deep` or `guarded` (nested calls run directly)."""
    return getattr(_local, "inside", False)


def deep(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread with a large stack and a high recursion limit."""
    if inside():
        return fn(*args)
    box: dict[str, Any] = {}

    def target() -> None:
        _local.inside = True
        _raise_limit()
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
        finally:
            _restore_limit()

    with _limit_lock:
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name="ddpify-deep", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _raise_limit() -> None:
    # The limit is global to the interpreter: raise it while any deep thread runs.
    global _deep_threads, _saved_limit
    with _limit_lock:
        if _deep_threads == 0:
            _saved_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_saved_limit, RECURSION_LIMIT))
        _deep_threads += 1


def _restore_limit() -> None:
    global _deep_threads
    with _limit_lock:
        _deep_threads -= 1
        if _deep_threads == 0:
            sys.setrecursionlimit(_saved_limit)


def guarded(fn: Callable[..., T], text: str, *args: Any, timeout: float | None = None) -> T:
    """`fn(text, *args)`: in a forked child when `text` is risky, else in a deep thread.

    Raises GaveUp when the child crashes or runs past `timeout` seconds.
    """
    if inside() or not risky(text) or not can_fork():
        return deep(fn, text, *args)
    return isolated(fn, text, *args, timeout=FILE_TIMEOUT if timeout is None else timeout)


def can_fork() -> bool:
    # Closures (a linter bound to a config) cross into a forked child without pickling.
    return "fork" in multiprocessing.get_all_start_methods()


def isolated(fn: Callable[..., T], *args: Any, timeout: float = FILE_TIMEOUT) -> T:
    """`fn(*args)` in a forked child process; its result or exception comes back."""
    if not can_fork():
        return deep(fn, *args)
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(writer, fn, args), name="ddpify-isolated")
    child.start()
    writer.close()
    try:
        if not reader.poll(timeout):
            raise GaveUp(f"gave up after {timeout:g} s (the file is too complex to analyse)")
        try:
            status, payload = reader.recv()
        except (EOFError, OSError):
            child.join()
            raise GaveUp(_death(child.exitcode)) from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        reader.close()
    if status == "error":
        raise payload
    return payload


class Beside:
    """`fn(*args)` run in a forked child while this process goes on; `result()` waits for
    it and returns its value or raises its exception. Where fork is not available, or
    when the child dies, `result()` runs `fn(*args)` here instead: the work is done
    either way, in parallel when it can be. `close()` stops a child no longer needed."""

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._child = None
        if can_fork():
            context = multiprocessing.get_context("fork")
            self._reader, writer = context.Pipe(duplex=False)
            self._child = context.Process(
                target=_child, args=(writer, fn, args), name="ddpify-beside"
            )
            self._child.start()
            writer.close()

    def result(self) -> Any:
        if self._child is None:
            return self._fn(*self._args)
        try:
            status, payload = self._reader.recv()
        except (EOFError, OSError):
            status, payload = "died", None
        finally:
            self.close()
        if status == "died":
            return self._fn(*self._args)
        if status == "error":
            raise payload
        return payload

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            if child.is_alive():
                child.kill()
            child.join()
            self._reader.close()


def _child(writer, fn: Callable[..., Any], args: tuple) -> None:
    _local.inside = False
    faulthandler.disable()  # a crash here is reported by the parent, not dumped
    try:
        message: tuple[str, Any] = ("ok", deep(fn, *args))
    except BaseException as exc:  # noqa: BLE001 - sent back to the parent
        message = ("error", exc)
    try:
        writer.send(message)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
        writer.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    writer.close()
    os._exit(0)  # skip the parent's atexit handlers, inherited through fork


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"libcst's parser crashed on this file ({name}); ddpify skipped it"
    return f"the analysis of this file stopped unexpectedly (exit status {exitcode})"
