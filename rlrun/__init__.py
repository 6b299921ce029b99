"""rlrun: Ray-free RL post-training for LLMs. Importing any part of it first makes Megatron run eagerly
(rlrun/runtime/megatron_eager.py), before anything can import Megatron."""

from rlrun.runtime.megatron_eager import install as _run_megatron_eagerly

_run_megatron_eagerly()
