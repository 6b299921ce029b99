"""The run config: typed schema (``schema``) and YAML loading with dotted overrides and base files (``load``).

A leaf: it imports nothing else of rlrun and reads no file but the YAML; ``rlrun.preflight`` checks what a
config names."""

from rlrun.config.load import ConfigError, LoadedConfig, dump_config, load_config, read_config
from rlrun.config.schema import RunConfig

__all__ = ["ConfigError", "LoadedConfig", "RunConfig", "dump_config", "load_config", "read_config"]
