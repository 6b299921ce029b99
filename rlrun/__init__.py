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
    """``rlrun.train`` (``rlrun.trainer.api.train``, its signature and docstring), imported on first use so that
    ``import rlrun`` stays light. The package root is the top of the import graph: it may import any module,
    and no module imports it (tests/unit/test_dependency_rules.py)."""
    if name == "train":
        from rlrun.trainer.api import train

        return train
    raise AttributeError(f"module 'rlrun' has no attribute {name!r}")
