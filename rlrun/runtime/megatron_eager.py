"""Megatron without its import-time ``torch.compile``: the jit fuser is off before any Megatron module uses it.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when it is imported, and ``import megatron.core`` then
decorates some thirty fused activations with it, which imports TorchDynamo and Inductor into every trainer
process, more CPU time than importing torch itself. rlrun turns every Megatron fusion off
(``rlrun/megatron/hf_config.py``: bias-activation, softmax, RoPE, gradient-accumulation fusion), so none of those
functions is compiled for a reason: the trainer runs eagerly, as the engine does, which is also what keeps the two
exact (docs/on_policy.md). :func:`install` hooks the import of ``megatron.core.jit`` and calls Megatron's own
``disable_jit_fuser()`` right after it runs, before the modules that read ``jit_fuser``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


class _EagerJitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` like the default finders do, and disables the fuser once it has executed."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # one use; also keeps find_spec below from finding this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Disable Megatron's jit fuser for this process; idempotent. Once Megatron is imported it only turns the fuser off
    for what is decorated later (what its import decorated stays compiled)."""
    if JIT_MODULE in sys.modules:
        sys.modules[JIT_MODULE].disable_jit_fuser()
        return
    if not any(isinstance(finder, _EagerJitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFinder())
