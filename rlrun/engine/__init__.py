"""Rollout engines behind one RPC contract (shared/reference/sglang-contract.md, section 5).

``client.EngineClient`` (trainer side) spawns ``worker`` (a separate process) which serves a backend
(``backends.embedded`` now; a future ``backends.sglang`` is the only module allowed to import
sglang). ``payload`` builds SGLang-compatible weight buckets, ``rpc`` is the ZeroMQ transport and
``lifecycle`` holds the contract's state rules. Nothing here imports Megatron.
"""
