"""A fake ``sglang.Engine`` reproducing 0.5.17's or 0.5.23's API surface for the SGLang worker's CPU tests.

The model runs in-process on CPU through rlrun's embedded engine (real generation, so the same
contract tests pass against it); everything around it -- constructor arguments, ``loop``,
``async_generate``'s output shape, ``tokenizer_manager`` controls and their failure modes,
``get_model_info`` -- follows the wheels (see ``srt/managers/tokenizer_manager.py``). ``Engine`` is
0.5.17's (entrypoints/engine.py:216-1540 there: no sessions, no ``get_model_info``); ``sglang.__version__``
(``FAKE_SGLANG_VERSION``) >= 0.5.23 swaps in ``Engine0523``, as installing the other wheel would.

Like the real one it starts a scheduler process (sglang's schedulers and detokenizer hold the GPU
memory, not the process that built the ``Engine``; they die with their parent) and ``shutdown`` ends
it, so leftover-process checks and per-process memory accounting meet the real process layout.

Two things are logged for tests to check the adapter's side of the contract: the constructor's
keyword arguments and the environment facts that matter (one ``fake-sglang-engine {json}`` line).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import sglang
from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager, TokenizerManager0523
from sglang.srt.utils.common import MultiprocessingSerializer

# A subset of ServerArgs' fields (srt/arg_groups/fields/): enough for the adapter and its tests.
SERVER_ARGS = {
    "model_path": None,
    "tp_size": 1,
    "nccl_port": None,
    "base_gpu_id": 0,
    "gpu_id_step": 1,
    "device": None,
    "random_seed": None,
    "dtype": "auto",
    "log_level": "error",
    "mem_fraction_static": None,
    "max_total_tokens": None,
    "max_running_requests": None,
    "enable_memory_saver": False,
    "enable_weights_cpu_backup": False,
    "enable_return_routed_experts": False,
    "skip_tokenizer_init": False,
    "skip_server_warmup": False,
    "load_format": "auto",
    "weight_version": "default",
    "enable_deterministic_inference": False,
    "disable_cuda_graph": False,
    "cuda_graph_backend_decode": None,
    "cuda_graph_backend_prefill": None,
    "port": 30000,
    "sampling_backend": None,
    "attention_backend": None,
}


# The scheduler stand-in: idles until shutdown kills it, or ends itself once its parent is gone
# (sglang's kill_itself_when_parent_died).
# The engine's pid comes in argv, not from os.getppid() at start: an engine that dies before this child's first
# line would leave it reparented, reading init as its parent and holding the engine's stdout/stderr open forever.
SCHEDULER = "import os, sys, time\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: time.sleep(0.2)"


class Engine:
    tokenizer_manager_class = TokenizerManager

    def __init__(self, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(SERVER_ARGS))
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument '{unknown[0]}'")
        if kwargs.get("model_path") is None:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        self.server_args = {**SERVER_ARGS, **kwargs}
        if self.server_args["dtype"] == "auto":
            self.server_args["dtype"] = "float32"
        print(
            "fake-sglang-engine "
            + json.dumps(
                {
                    "version": sglang.__version__,
                    "kwargs": kwargs,
                    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    "torchrun_env": sorted(
                        k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT") if k in os.environ
                    ),
                }
            ),
            file=sys.stderr,
            flush=True,
        )
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # a process-wide side effect, as _set_envs_and_config
        self.tokenizer_manager = self.tokenizer_manager_class(self.server_args)
        self.loop = self._ensure_event_loop()
        self.scheduler = subprocess.Popen(
            [sys.executable, "-S", "-c", SCHEDULER, str(os.getpid())], stdin=subprocess.DEVNULL
        )

    @staticmethod
    def _ensure_event_loop() -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        rid=None,
        stream=False,
        return_routed_experts=False,
        logprob_start_len=None,
        **unsupported,
    ):
        if unsupported or prompt is not None or stream:
            raise NotImplementedError(f"the fake serves token ids without streaming, not {sorted(unsupported)}")
        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            return_routed_experts=return_routed_experts,
            logprob_start_len=logprob_start_len,
        )
        return await self.tokenizer_manager.generate_request(obj, None).__anext__()

    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def release_memory_occupation(self, tags=None):
        obj = ReleaseMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory_occupation(self, tags=None):
        obj = ResumeMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.resume_memory_occupation(obj, None))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """flattened_bucket callers pass one payload per TP rank; otherwise the list is pickled per rank."""
        payloads = (
            named_tensors
            if load_format == "flattened_bucket"
            else [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.server_args["tp_size"])]
        )
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=load_format, flush_cache=flush_cache
        )
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))

    def shutdown(self) -> None:
        """As entrypoints/engine.py:1207-1230: stop serving, then kill the processes below this one."""
        self.tokenizer_manager.shutdown()
        self.scheduler.kill()
        self.scheduler.wait()


class Engine0523(Engine):
    """0.5.23 adds weight-update sessions and ``get_model_info`` (engine.py:1587, 1643-1655)."""

    tokenizer_manager_class = TokenizerManager0523

    def get_model_info(self) -> dict:
        tm = self.tokenizer_manager
        return {
            "model_path": self.server_args["model_path"],
            "weight_version": tm.config_value("weight_version"),
            "load_format": self.server_args["load_format"],
            "is_generation": True,
        }

    def begin_weight_update(self, selector: str = "all"):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        return self.loop.run_until_complete(
            self.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector), None)
        )

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        return self.loop.run_until_complete(self.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))


if sglang.__version__ >= "0.5.23":
    Engine = Engine0523  # noqa: F811  (the version picks the API, as installing another wheel would)
