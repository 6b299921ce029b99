"""Tools around training: environment checks, memory estimates, model preparation and conversion, benchmarks."""
