"""The run config: typed schema (``schema``) and YAML loading with dotted overrides (``load``)."""

from rlrun.config.load import ConfigError, dump_config, load_config
from rlrun.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "dump_config", "load_config"]
