"""Resolve ``rollout.reward`` to a callable: a built-in name, ``module:function`` or ``path/to/file.py:function``.

This is the one place user reward hooks are imported. It runs when the config is loaded, so a typo
in a hook path fails in ``rlrun config validate`` rather than after the model has loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from rlrun.data.sample import Sample
from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS

RewardFn = Callable[[Sample], float]
SIGNATURE = "fn(sample: Sample) -> float"


class RewardSpecError(ValueError):
    """The reward spec cannot be resolved to a function with the expected signature."""


def load_reward_fn(spec: str) -> RewardFn:
    """Return the reward function named by ``spec``; raises ``RewardSpecError`` naming the spec."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _error(spec, f"not a built-in ({', '.join(BUILTIN_REWARDS)}) and not of the form module:function")
    module = _import_file(spec, Path(where)) if where.endswith(".py") else _import_module(spec, where)
    fn = getattr(module, name, None)
    if fn is None:
        raise _error(spec, f"'{where}' has no attribute '{name}'")
    _check_signature(spec, fn)
    return fn


def _import_module(spec: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise _error(spec, f"module '{module_name}' not found on sys.path") from None
        raise _error(spec, f"importing '{module_name}' raised {type(err).__name__}: {err}") from None
    except Exception as err:  # noqa: BLE001 - re-raised with the spec named
        raise _error(spec, f"importing '{module_name}' raised {type(err).__name__}: {err}") from None


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise _error(spec, f"file '{path}' not found (cwd {Path.cwd()})")
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
        raise _error(spec, f"importing '{path}' raised {type(err).__name__}: {err}") from None
    return module


def _check_signature(spec: str, fn: object) -> None:
    if not callable(fn):
        raise _error(spec, f"'{spec}' is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        raise _error(spec, "it is async; reward functions are called synchronously")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; the call will tell
    try:
        signature.bind(None)
    except TypeError:
        raise _error(spec, f"it takes {signature}") from None


def _error(spec: str, reason: str) -> RewardSpecError:
    reason = " ".join(reason.split())
    return RewardSpecError(f"reward '{spec}': {reason}; expected a built-in name or module:function / "
                           f"path/to/file.py:function with signature {SIGNATURE}")
