"""``algorithm.opd.teacher_engine: sglang`` through the fake SGLang (tests/fakes/sglang, serving SGLang's
prefill-only ``logprob_start_len`` contract): a real teacher worker scores samples, a trajectory's parts
included, and its log-probs equal the teacher's HF forward within 1e-4; the options it cannot honour are
refused at load."""

from __future__ import annotations

import os
import re

import pytest
import torch

from engine_contract import FAKES_DIR
from minimal_config import run_config
from rlrun.config.schema import RunConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.preflight.engine import engine_problems

pytestmark = pytest.mark.slow


def config(model_dir, **opd) -> RunConfig:
    rollout = opd.pop("rollout", {})
    return run_config(
        {
            "model": {"path": str(model_dir)},
            "rollout": rollout,
            "algorithm": {"opd": {"teacher_path": str(model_dir), "kl_coef": 0.2, **opd}},
        }
    )


def sample(index: int, prompt: list[int], response: list[int]) -> Sample:
    return Sample(index, Prompt(index, prompt, ""), response, "", [0.0] * len(response), "stop")


def test_sglang_teacher_scores_equal_the_teachers_hf_forward(tiny_model_dirs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlrun.rollout.teacher import TeacherEngine

    model_dir = tiny_model_dirs["qwen3"]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAKES_DIR), os.environ.get("PYTHONPATH")) if p))
    parts = [sample(1, [7, 8], [40, 41, 42]), sample(1, [9, 10, 11, 12], [50])]
    trajectory = Sample(**{**vars(parts[-1]), "parts": parts})
    samples = [sample(0, [5, 9, 11], [40, 7, 3, 200]), trajectory]
    teacher = TeacherEngine.spawn(config(model_dir, teacher_engine="sglang"), 0, tmp_path)
    try:
        teacher.score(samples)
    finally:
        teacher.close()
    assert "fake-sglang-engine" in (tmp_path / "teacher-0.log").read_text()  # the SGLang backend served it
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = [samples[0], *parts]
    with torch.no_grad():
        for s in scored:
            ids = s.prompt.prompt_ids + s.response_ids
            logits = hf(torch.tensor([ids])).logits[0, len(s.prompt.prompt_ids) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert len(s.teacher_logprobs) == len(s.response_ids)
            torch.testing.assert_close(torch.tensor(s.teacher_logprobs), want, atol=1e-4, rtol=0)
    assert trajectory.teacher_logprobs == parts[-1].teacher_logprobs


def test_teacher_engine_options_it_cannot_honour_are_refused(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen3"]

    def problems(cfg: RunConfig) -> str:
        return " | ".join(message for _, message in engine_problems(cfg))

    refused = problems(config(model_dir, teacher_engine="embedded", teacher_server_args={"mem_fraction_static": 0.3}))
    assert re.search(r"teacher_server_args \(\{'mem_fraction_static': 0.3\}\) must be empty", refused), refused
    refused = problems(config(model_dir, teacher_engine="sglang", rollout={"temperature": 0.7}))
    assert re.search(r"rollout.temperature \(0.7\) must be 1 with algorithm.opd.teacher_engine", refused), refused
    assert problems(config(model_dir, teacher_engine="sglang", teacher_server_args={"mem_fraction_static": 0.3})) == ""
