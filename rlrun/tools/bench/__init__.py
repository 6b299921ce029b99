"""GPU benchmarks behind ``rlrun bench``: rollout throughput and trainer -> engine weight sync.

Each benchmark builds random-initialised models of published shapes (throughput and bandwidth do not
depend on the weights' values), measures, and returns a typed result that the CLI prints as JSON.
"""
