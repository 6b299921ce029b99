"""The SGLang adapter's pure parts: output conversion against 0.5.23-shaped fixtures, sampling
params, and the payload check that keeps a bad payload from reaching (and killing) SGLang."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import io
import json
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from rlrun.engine.backends.sglang import check_payload, sglang_sampling_params, to_gen_result
from rlrun.engine.payload import (
    SGLANG_ALLOWED_GLOBALS,
    _SafeUnpickler,
    payload_globals,
    serialize_flattened_bucket,
)
from rlrun.engine.sampling import SamplingParams

FIXTURES = json.loads((Path(__file__).parents[1] / "fixtures" / "sglang_0_5_23_outputs.json").read_text())["cases"]
FAKE_COMMON = Path(__file__).parents[1] / "fakes" / "sglang" / "srt" / "utils" / "common.py"


@pytest.mark.parametrize("case", FIXTURES, ids=[c["name"] for c in FIXTURES])
def test_outputs_convert_to_gen_results(case):
    result = to_gen_result(case["output"], rid="ours", return_logprob=case["return_logprob"])
    assert result == {"rid": "ours", **case["expected"]}


def test_logprobs_of_other_tokens_are_refused():
    output = copy.deepcopy(FIXTURES[0]["output"])
    output["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(ValueError, match="output_token_logprobs of request a1b2-0 must list the output_ids"):
        to_gen_result(output, rid="x", return_logprob=True)


def test_sampling_params_are_sglangs_with_one_seed_per_sample():
    params = SamplingParams.from_dict(
        {
            "max_new_tokens": 9,
            "temperature": 0,
            "top_k": 0,
            "stop": "###",
            "stop_token_ids": [5],
            "n": 4,
            "sampling_seed": 2**63 + 5,
        }
    )
    prompt = [1, 2, 3]
    converted = [sglang_sampling_params(params, prompt, j) for j in range(4)]
    assert converted[0] == {
        "max_new_tokens": 9,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 1,
        "min_p": 0.0,
        "ignore_eos": False,
        "n": 1,
        "stop_token_ids": [5],
        "stop": ["###"],
        "sampling_seed": params.sample_seed(prompt, 0) % 2**63,
    }
    seeds = [c["sampling_seed"] for c in converted]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)  # SGLang's int64 range
    unseeded = sglang_sampling_params(SamplingParams.from_dict({"top_k": 0}), prompt, 0)
    assert unseeded["top_k"] == -1 and "sampling_seed" not in unseeded and "stop" not in unseeded


def test_payload_globals_are_read_without_unpickling():
    payload = serialize_flattened_bucket([("a", torch.randn(3, 4)), ("b", torch.randn(5).bfloat16())])
    seen = []

    class Recording(_SafeUnpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    found = payload_globals(payload)
    Recording(io.BytesIO(payload)).load()  # the real unpickling, as the reference
    assert found == seen
    check_payload(payload, _SafeUnpickler)


@dataclasses.dataclass
class OwnMetadata:
    name: str


class Gadget:
    def __reduce__(self):
        return (print, ("should-never-run",))


@pytest.mark.parametrize("foreign, named", [(OwnMetadata("x"), "OwnMetadata"), (Gadget(), "builtins.print")])
def test_payloads_sglang_would_refuse_are_refused_before_sending(foreign, named):
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [foreign]})
    with pytest.raises(ValueError, match=rf"payload global .*{named} must be on the installed SGLang's unpickling"):
        check_payload(buf.getvalue(), _SafeUnpickler)  # 0.5.23's allowlist, as rlrun mirrors it
    with pytest.raises(ValueError):
        check_payload(pickle.dumps([foreign], protocol=2), _SafeUnpickler)  # GLOBAL opcodes (protocol < 4) too


def test_allowlist_matches_the_fakes_verbatim_copy_of_sglangs():
    """rlrun's regrouped allowlist and the fake's verbatim one (from the 0.5.23 wheel) are the same set."""
    spec = importlib.util.spec_from_file_location("fake_sglang_common", FAKE_COMMON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SafeUnpickler.ALLOWED_GLOBALS == SGLANG_ALLOWED_GLOBALS
