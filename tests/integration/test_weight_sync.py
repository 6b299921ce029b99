"""Weight sync and conversion, end to end: the engine's log-probs of its own samples equal the
Megatron forward's, right after a sync, and again after a training step and a new sync."""

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOL = 1e-4


def _engine_vs_trainer(model_dir: str, run_dir: str, tp: int):
    from rlrun.data.batch import collate
    from rlrun.data.sample import Prompt, Sample
    from rlrun.engine.client import EngineClient
    from rlrun.engine.registry import BackendSpec
    from rlrun.megatron import build_model, compute_logprobs, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=1, seed=7)
    engine = EngineClient.spawn(BackendSpec("embedded", str(model_dir), 3), run_dir=run_dir, rank=parallel.rank)
    try:
        model = build_model(model_dir, parallel, dtype="float32")
        optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
        prompts = [[257, 84, 82, 68], [257, 64, 82, 82, 72, 82]]
        params = {
            "max_new_tokens": 6,
            "temperature": 0.8,
            "top_p": 1.0,
            "top_k": -1,
            "n": 2,
            "sampling_seed": 11,
            "ignore_eos": True,
        }

        def gap(version: str):
            results = engine.generate(prompts, params, return_logprob=True)
            assert all(r["weight_version"] == version for r in results)
            samples = [
                Sample(
                    group_index=i // 2,
                    prompt=Prompt(index=i // 2, prompt_ids=prompts[i // 2], prompt_text=""),
                    response_ids=r["output_ids"],
                    response_text="",
                    rollout_logprobs=r["output_logprobs"],
                    finish_reason="length",
                )
                for i, r in enumerate(results)
            ]
            mb = collate(samples, [1.0, -1.0, 0.5, -0.5], pad_token_id=0)
            with torch.no_grad():
                trainer = compute_logprobs(model, mb.tokens, mb.position_ids, 0.8).float()
            mask = mb.loss_mask.bool()
            return (trainer[mask] - mb.rollout_logprobs[mask]).abs().max().item(), mb, trainer[mask]

        engine.update_weights(export_hf_weights(model), weight_version="1", bucket_bytes=1 << 14)
        gap_before, mb, trainer_before = gap("1")

        def loss_fn(batch, logprobs):
            loss = -(logprobs * batch.advantages * batch.loss_mask).sum()
            return loss, {"loss_sum_check": loss.detach()}

        train_step(model, optimizer, [mb], loss_fn, num_global_tokens=int(mb.loss_mask.sum()), temperature=0.8)
        with torch.no_grad():
            trainer_after_same_tokens = compute_logprobs(model, mb.tokens, mb.position_ids, 0.8).float()[
                mb.loss_mask.bool()
            ]
        engine.update_weights(export_hf_weights(model), weight_version="2", bucket_bytes=1 << 14)
        gap_after, _, _ = gap("2")
        moved = (trainer_after_same_tokens - trainer_before).abs().max().item()
        return {"gap_before": gap_before, "gap_after": gap_after, "moved": moved}
    finally:
        engine.shutdown()
        destroy_distributed()


@pytest.mark.parametrize("kind,tp", [("qwen3", 1), ("llama", 1), ("qwen2", 2)])
def test_engine_logprobs_match_megatron_after_sync_and_training(tiny_model_dirs, tmp_path, kind, tp):
    out = run_distributed(_engine_vs_trainer, tp, str(tiny_model_dirs[kind]), str(tmp_path), tp)
    assert out["gap_before"] < TOL, out
    assert out["gap_after"] < TOL, out
    assert out["moved"] > 10 * TOL, out  # the step really changed the policy the engine now serves
