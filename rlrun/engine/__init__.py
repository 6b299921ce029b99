"""Rollout engines behind one RPC contract (docs/engine-contract.md).

``client.EngineClient`` (trainer side) spawns ``worker`` (a separate process, its own process
group) which serves a backend on an asyncio loop: ``backends.embedded`` (pure PyTorch, CPU or one
GPU) or ``backends.sglang`` (hosts ``sglang.Engine``; the only module that imports sglang). ``rpc``
is the ZeroMQ transport with per-call timeouts and heartbeats, ``payload`` builds SGLang-compatible
weight buckets, ``lifecycle`` holds the contract's state rules and ``sampling`` the sampling
parameters. Nothing here imports Megatron.
"""
