"""``algorithm.opd.teacher_engine``: a teacher engine worker beside each rank's engine scores that rank's
samples during the rollout (slime's ``sglang`` OPD form), so the teacher may be of another size or
architecture than the student; it must share the student's tokenizer (token ids are compared, not text).

    rank r:  engine-r (student) ──samples──> teacher-r.score_tokens(prompt + response, start=len(prompt))
             Sample.teacher_logprobs ──collate──> MicroBatch.teacher_logprobs ──> the OPD advantage penalty

The teacher's log-probs are ``log_softmax(logits / rollout.temperature)`` over the whole vocabulary, as the
trainer-side teacher's are (rlrun/trainer/roles.py). The teacher worker keeps its weights resident.
"""

from __future__ import annotations

from pathlib import Path

from rlrun.config.schema import RunConfig
from rlrun.data.sample import Sample


class TeacherEngine:
    """One rank's teacher worker and the rollout temperature its scores use."""

    def __init__(self, client, temperature: float) -> None:
        self.client, self.temperature = client, temperature

    @classmethod
    def spawn(cls, cfg: RunConfig, rank: int, run_dir: Path) -> TeacherEngine:
        from rlrun.engine.client import EngineClient
        from rlrun.engine.registry import BackendSpec

        opd = cfg.algorithm.opd
        assert opd.teacher_path is not None, "check_algorithm pairs teacher_path with kl_coef"
        spec = BackendSpec(
            str(opd.teacher_engine),
            opd.teacher_path,
            seed=cfg.train.seed + rank,
            dtype=cfg.model.dtype,
            server_args=dict(opd.teacher_server_args),
        )
        client = EngineClient.spawn(
            spec,
            run_dir=run_dir,
            rank=rank,
            name="teacher",
            startup_timeout_s=cfg.engine.startup_timeout_s,
            request_timeout_s=cfg.engine.request_timeout_s,
            heartbeat_timeout_s=cfg.engine.heartbeat_timeout_s,
        )
        return cls(client, cfg.rollout.temperature)

    def score(self, samples: list[Sample]) -> None:
        """Set every sample's ``teacher_logprobs`` (one per response token) in one engine call; a trajectory
        of several parts has each part scored (the trajectory's own copy of its last part shares its scores)."""
        targets = [part for s in samples for part in (s.parts or [s])]
        if not targets:
            return
        sequences = [s.prompt.prompt_ids + s.response_ids for s in targets]
        starts = [len(s.prompt.prompt_ids) for s in targets]
        for sample, logprobs in zip(
            targets, self.client.score_tokens(sequences, starts, self.temperature), strict=True
        ):
            sample.teacher_logprobs = logprobs
        for sample in samples:
            if sample.parts:
                sample.teacher_logprobs = sample.parts[-1].teacher_logprobs

    def close(self) -> None:
        self.client.shutdown()


def check_teacher_tokenizer(cfg: RunConfig, tokenizer, parallel) -> None:
    """Collective over ``parallel.cpu_group``, before any rank spawns a teacher: rank 0 alone loads the teacher's
    tokenizer and compares it with the student's (``tokenizer``, loaded already), and every rank raises the
    same error when they differ."""
    from rlrun.data.transfer import scatter_from_rank0

    teacher_path = cfg.algorithm.opd.teacher_path
    assert teacher_path is not None, "check_algorithm pairs teacher_path with kl_coef"
    verdict = tokenizer_mismatch(tokenizer, cfg.model.path, teacher_path) if parallel.is_rank0 else None
    problem = scatter_from_rank0([verdict] * parallel.world_size if parallel.is_rank0 else None, parallel.cpu_group)
    if problem is not None:
        raise ValueError(problem)


def tokenizer_mismatch(student, student_path: str, teacher_path: str) -> str | None:
    """Why ``teacher_path``'s tokenizer does not map every token to the same id as the student's (``student``,
    the tokenizer of ``student_path``), or None: the teacher scores the student's token ids as they are."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_path)
    if student.get_vocab() == teacher.get_vocab() and student.all_special_ids == teacher.all_special_ids:
        return None
    only = len(set(student.get_vocab().items()) ^ set(teacher.get_vocab().items()))
    return (
        f"algorithm.opd.teacher_path ({teacher_path}) must have model.path's tokenizer ({student_path}) "
        f"because the teacher engine scores the student's token ids; {only} (token, id) pairs differ"
        f"{'' if only else ' (the special tokens do)'}; pick a teacher of the same tokenizer family"
    )
