"""Everything a config names, checked before any process starts: ``rlrun config validate`` and ``rlrun train``
both call :func:`preflight`.

The config (rlrun/config/) only describes the run; this checks what it points at, each problem one line
led by the file and line of its key (a base file's line when the key came from a base)::

    0. paths       hub ids of model directories resolved to local snapshots          (rlrun/data/hub.py)
    1. engine      backend names and what ``engine.*`` asks of the backend's traits   (engine.py)
    2. algorithm   estimator and loss names, their settings, what they need           (rlrun/algo/validate.py)
    3. hooks       every user hook the config sets, resolved against one table        (hooks.py)
    4. inputs      model directories, prompt files and rows, the critic's YAML        (inputs.py, critic.py)
    5. models      the model family, refused as ``train`` refuses it                  (models.py)

Imports no torch: ``config validate`` stays instant.
"""

from __future__ import annotations

from rlrun.algo.validate import algorithm_problems
from rlrun.config import LoadedConfig, RunConfig
from rlrun.data.hub import ModelPathError, with_local_model_paths
from rlrun.preflight.engine import engine_problems
from rlrun.preflight.hooks import hook_problems
from rlrun.preflight.inputs import input_problems
from rlrun.preflight.models import family_problems

__all__ = ["config_problems", "preflight"]


def preflight(loaded: LoadedConfig) -> RunConfig:
    """The config, its hub model ids resolved to local directories, once every check passed; else
    ``ConfigError`` with one line per problem."""
    try:
        cfg = with_local_model_paths(loaded.cfg)
    except ModelPathError as err:
        raise loaded.error([(str(err).split(" ", 1)[0], str(err))]) from None
    error = loaded.error(config_problems(cfg))
    if error is not None:
        raise error
    return cfg


def config_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Every problem of ``cfg`` as (dotted key, message); the keys' places are the caller's to add."""
    problems = engine_problems(cfg) + algorithm_problems(cfg) + hook_problems(cfg)
    return problems + input_problems(cfg) + family_problems(cfg)
