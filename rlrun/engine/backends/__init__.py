"""Backends built on an external inference engine (SGLang); the embedded engine is ``rlrun.engine.embedded``."""
