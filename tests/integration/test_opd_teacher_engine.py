"""On-policy distillation from a separate teacher engine (``algorithm.opd.teacher_engine``): a tiny random
student sharing SmolLM2's tokenizer trains one CLI step (2 ranks) while SmolLM2-135M, in its own engine
worker per rank, scores the student's samples; the scores it handed the trainer equal SmolLM2's own HF
forward within 1e-4, and a teacher of another tokenizer is refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dist_utils import run_distributed
from integration.test_train_loop import REPO, run_train

SMOLLM2 = REPO / ".cache/models/SmolLM2-135M-Instruct"
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("smollm2")]  # the teacher, prepared by conftest


def make_student(out_dir):
    """A 2-layer random Llama over SmolLM2's tokenizer (ids and special tokens as the teacher's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tiny_models import tiny_config

    tokenizer, teacher = AutoTokenizer.from_pretrained(SMOLLM2), AutoConfig.from_pretrained(SMOLLM2)
    config = tiny_config("llama", vocab_size=teacher.vocab_size, tie=True)
    config.update({k: getattr(teacher, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_teacher_engine_scores_equal_the_teachers_hf_forward(tmp_path, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    student, run_dir = make_student(tmp_path / "student"), tmp_path / "run"
    records = run_train(
        student,
        run_dir,
        "train.num_steps=1",
        f"algorithm.opd.teacher_path={SMOLLM2}",
        "algorithm.opd.kl_coef=0.2",
        "algorithm.opd.teacher_engine=embedded",
        "debug.save_rollout_data=true",
    )
    assert records[0]["train/opd_reverse_kl"] > 0  # a random student is far from the teacher
    assert (run_dir / "teacher-0.log").is_file() and (run_dir / "teacher-1.log").is_file()

    rows = [json.loads(line) for line in (run_dir / "debug/rollout_000000.jsonl").read_text().splitlines()]
    teacher = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for row in rows:
            prompt, response = row["prompt"]["prompt_ids"], row["response_ids"]
            logits = teacher(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()  # T = 1
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            gaps.append((torch.tensor(row["teacher_logprobs"]) - want).abs().max().item())
    assert len(rows) == 32 and max(gaps) < 1e-4, max(gaps)


def _check_tokenizers(student_dir: str, teacher_dir: str) -> str | None:
    from transformers import AutoTokenizer

    from minimal_config import run_config
    from rlrun.rollout.teacher import check_teacher_tokenizer
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, 0)
    try:
        opd = {"teacher_path": teacher_dir, "kl_coef": 0.2, "teacher_engine": "embedded"}
        cfg = run_config({"model": {"path": student_dir}, "algorithm": {"opd": opd}})
        try:
            check_teacher_tokenizer(cfg, AutoTokenizer.from_pretrained(student_dir), parallel)
        except ValueError as err:
            return str(err)
        return None
    finally:
        destroy_distributed()


def test_a_teacher_of_another_tokenizer_is_refused_on_every_rank(tiny_model_dirs):
    """Rank 0 alone loads the teacher's tokenizer; both ranks raise its verdict before any teacher starts."""
    verdicts = run_distributed(_check_tokenizers, 2, str(tiny_model_dirs["qwen3"]), str(SMOLLM2), all_ranks=True)
    assert verdicts[0] == verdicts[1] and verdicts[0] is not None
    assert re.search(r"must have model.path's tokenizer .* \(token, id\) pairs differ", verdicts[0]), verdicts[0]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_embedded_score_tokens_equal_an_hf_forward_at_a_temperature(kind, tiny_model_dirs, tiny_moe_dir):
    """In process, on a tiny model with QK-norm (dense, and MoE: scoring leaves the last generation's routing
    record alone): several sequences of other lengths and starts, T = 0.7."""
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded.engine import EmbeddedEngine

    path = tiny_moe_dir if kind == "qwen3_moe" else tiny_model_dirs[kind]
    engine, reference = EmbeddedEngine(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    recorded = engine._prefill_experts = torch.zeros(1)  # stands in for the last generation's record
    sequences, starts = [[5, 9, 11, 40, 7, 3], [17, 2, 2, 90, 100, 31, 8, 64, 1], [3, 4]], [3, 1, 1]
    scores = engine.score_tokens(sequences, starts, temperature=0.7)
    with torch.no_grad():
        for ids, start, got in zip(sequences, starts, scores, strict=True):
            logits = reference(torch.tensor([ids])).logits[0, start - 1 : -1].float() / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]
            assert len(got) == len(ids) - start and torch.allclose(torch.tensor(got), want, atol=1e-5)
    with pytest.raises(ValueError, match=r"start \(0\) must be in \[1, 2\]"):
        engine.score_tokens([[3, 4]], [0])
    assert engine._prefill_experts is recorded
