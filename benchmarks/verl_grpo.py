"""verl's GRPO (FSDP trainer, SGLang rollout, colocated) on the inputs of ``rlrun bench step``: seconds per step.

The same work as benchmarks/trl_grpo.py and ``rlrun bench step``: the random-init model directory and prompts
of ``rlrun.tools.bench.step.prepare_inputs`` (the prompts go into a parquet file as one user message each, and a
chat template that only joins the messages' text keeps each prompt exactly ``prompt_len`` tokens), the group
size (``rollout.n``), the fixed response length (``rollout.ignore_eos`` with ``response_length`` = new_tokens),
sampling at temperature 1 without top-k/top-p, the learning rate with no warm-up and no weight decay, gradient
clipping at 1, GRPO advantages normalised by the group's std, clip 0.2, token-mean loss, no KL and no
reference model, one optimizer step per rollout (``ppo_mini_batch_size`` = prompts), the same reward
(benchmarks/verl_plugins.py). With one update per rollout the old-policy log-probs are the rollout's
(``algorithm.rollout_correction.bypass_mode``), as rlrun's are; with more, verl recomputes them, as rlrun does.

verl is configured as its performance guide (docs/perf/perf_tuning.rst) recommends: FSDP2, ``use_remove_padding``
(packed rows), ``use_dynamic_bsz`` with a token budget per micro-batch of ``micro_batch_samples`` full samples
(rlrun's ``train.max_tokens_per_micro_batch``), no gradient checkpointing (rlrun recomputes nothing either),
the async SGLang server with CUDA graphs, PyTorch sampling and fa3 attention (what rlrun's SGLang engine
runs), the FSDP trainer's fp32 master weights with bf16 compute. Left at verl's defaults: torch.compile of
its log-prob/entropy functions, the 2 GiB weight-sync buckets, 8 agent-loop workers. Not used: Liger kernels (not
staged; the guide lists them for SFT), Ulysses (one GPU). The packed rows attend through FlashAttention-2's varlen
kernel as torch builds it in (benchmarks/verl_plugins.py says why not the flash-attn package).

One change to verl's own behaviour: its sync trainer notices that a rollout is done by polling every 2 s (a
constructor default that no config key reaches), so up to 2 s of each step would be sleep; the benchmark polls
every ``--replay-poll-s`` (0.1 s; ``2`` for verl's own; benchmarks/verl_plugins.py).

``--offload on``: the colocated hybrid engine frees SGLang's weights and KV cache during training
(``free_cache_engine``) and FSDP moves parameters and optimizer state to host memory during rollout
(``param_offload`` / ``optimizer_offload``), SGLang taking 0.3 of the device; ``off``: both stay resident,
SGLang taking 0.15 (rlrun's two settings, rlrun.tools.bench.step).

Timing is verl's own: its trainer's ``timing_s/<phase>`` metrics per step (gen, old_log_prob, ref, adv,
update_actor, update_weights, ... whichever ran), written by its ``file`` logger; ``step`` is
``timing_s/step``. Medians leave out the warm-up steps (``rlrun.tools.bench.step.WARMUP_STEPS``, as rlrun's and
TRL's do). The output is the record benchmarks/peer_step.py reads (the keys trl_grpo.py writes).

    python benchmarks/verl_grpo.py --work /tmp/peer_qwen3-0.6b --shape qwen3-0.6b --steps 5 --offload on \\
        --out /tmp/peer_qwen3-0.6b/verl.json

Needs verl 0.9.1 with its Python dependencies next to SGLang 0.5.17 (scripts/gpu/verl_session.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import add_settings_args, settings_from, write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlrun.tools.bench.engines import SGLANG_SERVER_ARGS  # noqa: E402
from rlrun.tools.bench.logged import run_logged_session  # noqa: E402
from rlrun.tools.bench.step import RESIDENT_SGLANG_MEM_FRACTION, WARMUP_STEPS, StepSettings, prepare_inputs  # noqa: E402

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The prompt's words as they are: the tokenizer has no template, and rlrun and TRL tokenize the bare text."""
PHASE_PREFIX = "timing_s/"
REPLAY_POLL_S = 0.1
"""Seconds between the sync trainer's looks for a finished rollout (verl's own: 2.0)."""
REPLAY_POLL_ENV = "VERL_BENCH_REPLAY_POLL_S"
"""How the interval reaches verl's trainer process: verl_plugins.py reads it under the same name (it cannot import
this module, which needs rlrun, in verl's processes)."""


def write_dataset(inputs_dir: Path, run_dir: Path) -> Path:
    """The prompts as the parquet file verl's RLHFDataset reads: a user message, a data source and the
    ``reward_model`` field its reward manager requires."""
    import pandas as pd

    rows = [json.loads(line) for line in (inputs_dir / "prompts.jsonl").read_text().splitlines()]
    frame = pd.DataFrame(
        {
            "data_source": ["bench_step"] * len(rows),
            "prompt": [[{"role": "user", "content": row["prompt"]}] for row in rows],
            "reward_model": [{"style": "rule", "ground_truth": ""}] * len(rows),
            "extra_info": [{"index": i} for i in range(len(rows))],
        }
    )
    path = run_dir / "prompts.parquet"
    frame.to_parquet(path)
    return path


def overrides(settings: StepSettings, inputs_dir: Path, data: Path, run_dir: Path, offload: bool) -> dict[str, object]:
    """verl's Hydra overrides for this work (``+`` marks keys verl's ppo_trainer.yaml does not list)."""
    sample_len = settings.prompt_len + settings.new_tokens
    model = "actor_rollout_ref.model."
    actor = "actor_rollout_ref.actor."
    rollout = "actor_rollout_ref.rollout."
    # rlrun's engine samples in PyTorch and attends with SGLang's Hopper default, fa3; verl would pick flashinfer
    sglang_args = {"sampling_backend": SGLANG_SERVER_ARGS["sampling_backend"], "attention_backend": "fa3"}
    return {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": True,
        "algorithm.use_kl_in_reward": False,
        "algorithm.rollout_correction.bypass_mode": settings.updates_per_rollout == 1,
        "data.train_files": str(data),
        "data.val_files": str(data),
        "data.train_batch_size": settings.prompts,
        "data.max_prompt_length": settings.prompt_len,
        "data.max_response_length": settings.new_tokens,
        "data.filter_overlong_prompts": False,
        "data.truncation": "error",
        "data.shuffle": False,
        "data.seed": settings.seed,
        model + "path": str(inputs_dir / "model"),
        model + "use_remove_padding": True,
        model + "enable_gradient_checkpointing": False,
        model + "custom_chat_template": CHAT_TEMPLATE,
        model + "external_lib": "verl_plugins",
        "+" + model + "override_config.attn_implementation": "torch_packed_varlen",
        actor + "strategy": "fsdp2",  # the guide's "Migrating to FSDP2": less memory, a little faster
        actor + "optim.lr": settings.lr,
        actor + "optim.weight_decay": 0.0,
        actor + "optim.betas": [0.9, 0.999],
        actor + "optim.clip_grad": 1.0,
        actor + "optim.lr_warmup_steps": 0,
        actor + "ppo_mini_batch_size": settings.prompts // settings.updates_per_rollout,
        actor + "use_dynamic_bsz": True,
        actor + "ppo_max_token_len_per_gpu": settings.micro_batch_samples * sample_len,
        actor + "use_kl_loss": False,
        actor + "kl_loss_coef": 0.0,
        actor + "entropy_coeff": 0.0,
        actor + "loss_agg_mode": "token-mean",
        actor + "clip_ratio_low": 0.2,
        actor + "clip_ratio_high": 0.2,
        actor + "ppo_epochs": 1,
        actor + "fsdp_config.param_offload": offload,
        actor + "fsdp_config.optimizer_offload": offload,
        rollout + "name": "sglang",
        rollout + "tensor_model_parallel_size": 1,
        rollout + "n": settings.samples,
        rollout + "temperature": 1.0,
        rollout + "top_k": -1,
        rollout + "top_p": 1.0,
        rollout + "ignore_eos": True,
        rollout + "seed": settings.seed,
        rollout + "gpu_memory_utilization": SGLANG_SERVER_ARGS["mem_fraction_static"]
        if offload
        else RESIDENT_SGLANG_MEM_FRACTION,
        rollout + "free_cache_engine": offload,
        rollout + "enforce_eager": False,
        **{f"+{rollout}engine_kwargs.sglang.{k}": v for k, v in sglang_args.items()},
        "reward.custom_reward_function.path": str(HERE / "verl_plugins.py"),
        "reward.custom_reward_function.name": "compute_score",
        # TransferQueue's storage units hold a Ray CPU each (default 8, sized for clusters); 128 samples need few
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 2,
        "trainer.n_gpus_per_node": 1,
        "trainer.nnodes": 1,
        "trainer.total_training_steps": settings.steps,
        "trainer.total_epochs": settings.steps,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": -1,
        "trainer.resume_mode": "disable",
        "trainer.logger": ["console", "file"],
        "trainer.project_name": "verl_grpo",
        "trainer.experiment_name": run_dir.name,
        "trainer.default_local_dir": str(run_dir / "checkpoints"),
    }


class Raw(str):
    """An override value given on the command line (``--set``), passed to Hydra as written."""


def hydra_value(value: object) -> str:
    """One override's value in Hydra's grammar (strings quoted, so templates and paths pass unparsed)."""
    if isinstance(value, Raw):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def hydra_args(values: dict[str, object]) -> list[str]:
    return [f"{key}={hydra_value(value)}" for key, value in values.items()]


def with_sets(values: dict[str, object], sets: list[str]) -> dict[str, object]:
    """``values`` with the ``--set KEY=VALUE`` overrides in place of (or after) the benchmark's own."""
    out = dict(values)
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set ({item}) must be KEY=VALUE because it is one Hydra override of verl's config")
        out["+" + key if "+" + key in out else key] = Raw(value)  # a key the benchmark adds keeps its "+"
    return out


def check_config(args: list[str]) -> dict:
    """verl's own checks of these overrides without a GPU: Hydra composes ppo_trainer.yaml with them (an unknown
    key fails), ``validate_config`` runs as main_ppo runs it, and the actor, rollout and algorithm sections
    become verl's typed configs, as its workers build them. Returns what the benchmark relies on."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=args)
    reference, critic = need_reference_policy(config), need_critic(config)
    validate_config(config=config, use_reference_policy=reference, use_critic=critic)
    OmegaConf.resolve(config)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    algorithm = omega_conf_to_dataclass(config.algorithm)
    return {
        "reference_model": reference,
        "critic": critic,
        "adv_estimator": algorithm.adv_estimator,
        "old_log_probs_from_rollout": config.algorithm.rollout_correction.bypass_mode,
        "actor_dynamic_bsz_tokens": actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        "actor_offload": [actor.fsdp_config.param_offload, actor.fsdp_config.optimizer_offload],
        "rollout": [rollout.name, rollout.n, rollout.response_length, rollout.ignore_eos, rollout.free_cache_engine],
        "sglang_mem_fraction": rollout.gpu_memory_utilization,
        "sglang_engine_kwargs": dict(rollout.engine_kwargs["sglang"]),
        "attn_implementation": config.actor_rollout_ref.model.override_config.attn_implementation,
    }


def run_verl(args: list[str], run_dir: Path, timeout_s: float, replay_poll_s: float) -> tuple[Path, str | None]:
    """``python -m verl.trainer.main_ppo ARGS`` in a session of its own, ended afterwards with Ray's workers
    (rlrun.tools.bench.logged.run_logged_session); returns the metrics file its ``file`` logger wrote, and why the run
    stopped early (None when it finished). A run that reaches ``timeout_s`` after more than the warm-up steps
    keeps the steps it logged (verl's start-up alone took ~5 minutes on the H200, so a limit that falls during
    the last step should not lose the others)."""
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")])),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "VERL_USE_EXTERNAL_MODULES": "verl_plugins",  # imported by every process that imports verl
        REPLAY_POLL_ENV: str(replay_poll_s),
        "HYDRA_FULL_ERROR": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    log = run_dir / "verl.log"
    code = run_logged_session([sys.executable, "-m", "verl.trainer.main_ppo", *args], log, timeout_s, env, run_dir)
    if code == "timeout" and len(logged_rows(metrics)) > WARMUP_STEPS:
        return metrics, f"timeout after {timeout_s:.0f} s"
    if code != 0 or not metrics.exists():
        raise RuntimeError(
            f"verl's main_ppo must exit 0 and write {metrics} but ended with {code}; its output ({log}) "
            f"ends with:\n{log.read_text()[-3000:]}"
        )
    return metrics, None


def logged_rows(metrics: Path) -> list[dict]:
    """The steps verl's ``file`` logger wrote (one JSON line each); none when it wrote no file."""
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def step_record(row: dict, settings: StepSettings) -> dict:
    """One step of verl's metrics: its phases' seconds (step excluded), response length, the trainer's peak
    memory and verl's MFU estimate for the actor update."""
    data = row["data"]
    phases = {k[len(PHASE_PREFIX) :]: v for k, v in data.items() if k.startswith(PHASE_PREFIX) and k != "timing_s/step"}
    tokens = round(data["response_length/mean"] * settings.prompts * settings.samples)
    return {
        "step": row["step"],
        "step_s": data["timing_s/step"],
        "phases_s": phases,
        "completion_mean_length": data["response_length/mean"],
        "output_tokens": tokens,
        "tokens_per_s": tokens / data["timing_s/step"],
        # the FSDP worker's own torch allocator (SGLang's memory is its server's process), as verl logs it
        "max_allocated_gib": data.get("actor/perf/max_memory_allocated_gb", 0.0),
        "max_reserved_gib": data.get("actor/perf/max_memory_reserved_gb", 0.0),
        "actor_mfu": data.get("perf/mfu/actor"),
    }


def summarise(settings: StepSettings, rows: list[dict], stopped: str | None = None) -> dict:
    """Per-step records and medians after the warm-up steps (the keys trl_grpo.py writes); a run ``stopped``
    early has fewer steps, and says so in ``stopped_early``."""
    if len(rows) != settings.steps and (stopped is None or len(rows) > settings.steps):
        raise RuntimeError(f"verl logged {len(rows)} steps but the run was set to {settings.steps}")
    records = [step_record(row, settings) for row in rows]
    warmup = WARMUP_STEPS if len(records) > WARMUP_STEPS else 0
    timed = records[warmup:]
    phases = sorted({p for r in timed for p in r["phases_s"]})
    return {
        "fixed_length": all(r["completion_mean_length"] == settings.new_tokens for r in records),
        "warmup_steps": warmup,
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "median_phases_s": {p: statistics.median(r["phases_s"].get(p, 0.0) for r in timed) for p in phases},
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "max_allocated_gib": max(r["max_allocated_gib"] for r in records),
        "max_reserved_gib": max(r["max_reserved_gib"] for r in records),
        "steps": records,
    } | ({"stopped_early": f"{stopped}: {len(rows)} of {settings.steps} steps"} if stopped else {})


def versions() -> dict[str, str | None]:
    """The versions of what ran (None: not installed in this interpreter)."""
    out: dict[str, str | None] = {}
    for name in ("verl", "sglang", "torch", "transformers", "ray", "tensordict", "transferqueue"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_settings_args(parser)
    parser.add_argument("--offload", choices=("on", "off"), default="on")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--replay-poll-s",
        type=float,
        default=REPLAY_POLL_S,
        help="Seconds between the sync trainer's looks for a finished rollout (verl's own: 2).",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A Hydra override of verl's config, replacing the benchmark's for that key (repeatable): e.g. "
        "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=flashinfer. The record lists them.",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="Only compose and validate verl's config with these overrides (no GPU, no model needed); print it.",
    )
    args = parser.parse_args(argv)
    settings = settings_from(args, "verl")
    if settings.prompts % settings.updates_per_rollout:
        raise SystemExit(
            f"--updates-per-rollout ({settings.updates_per_rollout}) must divide --prompts ({settings.prompts}) "
            "because verl's ppo_mini_batch_size counts prompts"
        )
    if args.replay_poll_s <= 0:
        raise SystemExit(f"--replay-poll-s ({args.replay_poll_s}) must be positive because it is a sleep between looks")
    offload = args.offload == "on"
    run_dir = args.work / ("verl" if offload else "verl_resident")
    if args.check_config:
        values = overrides(settings, args.work / "inputs", run_dir / "prompts.parquet", run_dir, offload)
        values = with_sets(values, args.set)
        print(json.dumps(check_config(hydra_args(values)), indent=2))
        return {}
    import torch

    on_gpu = torch.cuda.is_available()  # the inputs as trl_grpo.py writes them, so the two share one directory
    inputs_dir = prepare_inputs(settings, args.work, "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu")
    run_dir.mkdir(parents=True, exist_ok=True)
    values = overrides(settings, inputs_dir, write_dataset(inputs_dir, run_dir), run_dir, offload)
    values = with_sets(values, args.set)
    metrics, stopped = run_verl(hydra_args(values), run_dir, args.timeout_s, args.replay_poll_s)
    extra = {
        "offload": offload,
        "overrides": hydra_args(values),
        "replay_poll_s": args.replay_poll_s,
        **summarise(settings, logged_rows(metrics), stopped),
    }
    return write_result("verl_grpo", settings, versions(), extra, args.out)


if __name__ == "__main__":
    main()
