"""rlrun: Ray-free RL post-training for LLMs. Importing any part of it first makes Megatron run eagerly
(rlrun/runtime/megatron_eager.py), before anything can import Megatron.

    import rlrun
    rlrun.train("configs/quickstart.yaml", train={"num_steps": 2})

Importing the package imports neither torch nor Megatron: ``train`` loads them when called.
"""

from rlrun.runtime.megatron_eager import install as _run_megatron_eagerly

__version__ = "0.2.0"
__all__ = ["__version__", "train"]

_run_megatron_eagerly()


def __getattr__(name: str):
    """``rlrun.train``, loaded on first use. By name through importlib: the package root is imported by every
    module of it, so a plain import here would read as every module importing the trainer (an import circle)."""
    if name == "train":
        import importlib

        return importlib.import_module("rlrun.trainer.api").train
    raise AttributeError(f"module 'rlrun' has no attribute {name!r}")
