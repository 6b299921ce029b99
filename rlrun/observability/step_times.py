"""The names of a step's total times, importable without torch (``rlrun plot`` reads them)."""

STEP_SECONDS = "time/step_s"
"""The sum of a step's phases (``time/<phase>_s``, rlrun/observability/metrics.py's PhaseTimer)."""
WALL_STEP_SECONDS = "time/wall_step_s"
"""Rank 0's wall clock from the previous step's record (or the run's start) to this one: the phases and whatever
ran between them and between steps (logging, checkpoints, engine recovery), so a benchmark can check that the
phases cover the step."""
STEP_TOTALS = (STEP_SECONDS, WALL_STEP_SECONDS)
"""The ``time/*_s`` metrics that are totals, not phases."""
