"""Moved to :mod:`rlrun.trainer.offload`; this name stays so that older imports keep working (the same module
object, so attributes set on one are seen through the other)."""

import sys

from rlrun.trainer import offload

sys.modules[__name__] = offload
