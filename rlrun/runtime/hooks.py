"""User hooks by path: ``package.module:function`` or ``path/to/file.py:function``.

This is the one place user code is imported (rewards, custom advantages and losses, post-process
hooks), by whoever calls the hook and, before any process starts, by ``rlrun.preflight`` (its table of
every hook: config key, signature, where it is called), so a typo fails in ``rlrun config validate``
rather than after the model has loaded. ``resolve_hook`` says *why* a path does not resolve; callers
add which config key it came from and the signature they expect (``hook_error``). Stdlib only: every
package below the preflight may import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

_NOT_USER_CODE = tuple(
    str(Path(root).resolve())
    for root in (Path(__file__).parents[1], *(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")))
)
"""rlrun itself, the standard library and installed packages: a frame in none of them is the user's hook."""


class HookSpecError(ValueError):
    """A hook path cannot be resolved to a function with the expected signature; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = " ".join(reason.split())
        super().__init__(self.reason)


def resolve_hook(spec: str, num_args: int | None, allow_async: bool = False) -> Callable:
    """The function named by ``spec`` that accepts ``num_args`` positional arguments (synchronous
    unless ``allow_async``: rollout hooks run in an event loop, training hooks do not). ``num_args`` None
    leaves the parameters to the caller (a reward's signature is detected from them)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise HookSpecError("it is not of the form module:function or path/to/file.py:function")
    module = _import_file(Path(where)) if where.endswith(".py") else _import_module(where)
    fn = getattr(module, name, None)
    if fn is None:
        raise HookSpecError(f"'{where}' has no attribute '{name}'")
    _check_signature(spec, fn, num_args, allow_async)
    return fn


def load_hook(spec: str, key: str, signature: str, num_args: int) -> Callable:
    """``resolve_hook``, with errors that name the config ``key``, the path and the expected ``signature``."""
    try:
        return resolve_hook(spec, num_args)
    except HookSpecError as err:
        raise hook_error(key, spec, signature, err.reason) from None


def hook_error(key: str, spec: str, signature: str, reason: str) -> HookSpecError:
    return HookSpecError(
        f"{key} ('{spec}') must name a function with signature {signature}, but {reason}; "
        f"set {key} to module:function or path/to/file.py:function"
    )


def raised(err: BaseException) -> str:
    """``"Type: message"`` of an exception a user hook raised, with the innermost line of the user's own code
    it passed through (``(at path/to/file.py:12 in fn)``): a reward or agent that fails on one sample is
    logged once per step, and the message alone (``KeyError: 'answer'``) does not say which line to fix."""
    text = f"{type(err).__name__}: {err}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user_file(f.filename)]
    return f"{text} (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else text


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    resolved = str(Path(filename).resolve())
    return not any(resolved == root or resolved.startswith(root + "/") for root in _NOT_USER_CODE)


def _import_module(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise HookSpecError(f"module '{module_name}' not found on sys.path") from None
        raise HookSpecError(f"importing '{module_name}' raised {raised(err)}") from None
    except Exception as err:  # noqa: BLE001 - re-raised with the spec named
        raise HookSpecError(f"importing '{module_name}' raised {raised(err)}") from None


def _import_file(path: Path):
    if not path.is_file():
        raise HookSpecError(f"file '{path}' not found (cwd {Path.cwd()})")
    # A stable, path-derived module name: loading the same file twice reuses the module.
    module_name = "rlrun_user_hook_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if module_name in sys.modules:
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - re-raised with the spec named
        del sys.modules[module_name]
        raise HookSpecError(f"importing '{path}' raised {raised(err)}") from None
    return module


def _check_signature(spec: str, fn: object, num_args: int | None, allow_async: bool) -> None:
    if not callable(fn):
        raise HookSpecError(f"'{spec}' is of type {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) and not allow_async:
        raise HookSpecError("it is async; hooks are called synchronously")
    if num_args is None:
        return
    try:
        found = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; the call will tell
    try:
        found.bind(*([None] * num_args))
    except TypeError:
        raise HookSpecError(f"it takes {found}") from None
