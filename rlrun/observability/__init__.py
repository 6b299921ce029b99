"""What a run reports: metrics sinks, step-time names, the profiler, plots."""
