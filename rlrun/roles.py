"""Moved to :mod:`rlrun.trainer.roles`; this name stays so that older imports keep working (the same module
object, so attributes set on one are seen through the other)."""

import sys

from rlrun.trainer import roles

sys.modules[__name__] = roles
