"""rlrun (each engine backend) vs TRL's GRPOTrainer and verl, seconds per GRPO step, in one invocation
(the goals: ``GOALS``, ``GOALS_VS_VERL``).

Runs, one after another on the same device and the same inputs (one model directory and prompt file in
``--work/inputs``, written by the first run): benchmarks/trl_grpo.py, then benchmarks/verl_grpo.py for every
``--verl`` variant, then ``rlrun bench step --backend B`` for every backend. Each run is its own process, so
none sees another's memory. Writes one JSON with every result, the ratios (a peer's median seconds per step
/ rlrun's: how many times faster rlrun is; against verl, the verl run that offloads as the rlrun run does)
and the issues' goals, and prints a table. A run that fails is recorded with its output's tail; the others
still run.

``--backends`` lists rlrun variants, each ``BACKEND`` plus optional suffixes (the names
``rlrun.tools.bench.step.Variant.label`` gives): ``_resident`` (``--offload off``: trainer and engine both stay
on the device, as TRL's do), ``_keepnccl`` (``--teardown-nccl off``) and ``_varlen`` or ``_persample``
(``--packed-attention flash_varlen`` / ``per_sample``; without either, ``auto``: varlen on CUDA in bf16).
TRL runs once, first. ``--verl`` lists verl variants: ``verl`` (offload on: SGLang freed during training,
FSDP parameters and optimizer state on the host during rollout) and ``verl_resident`` (offload off).
``--trl-vllm`` lists TRL-with-vLLM variants (benchmarks/trl_grpo.py ``--use-vllm``, colocate mode):
``trl_vllm`` (vLLM's sleep mode on) and ``trl_vllm_resident`` (off); each rlrun run is paired with the
one that offloads as it does, as with verl.

    python benchmarks/peer_step.py --shape qwen3-0.6b --steps 5 \\
        --backends embedded,sglang,sglang_keepnccl,sglang_resident \\
        --work /tmp/peer_step --out benchmarks/results/peer_step_qwen3-0.6b_h200.json

``--trl-python`` / ``--verl-python`` / ``--trl-vllm-python``: the interpreters that have trl / verl / vLLM
and trl (default: this one; verl needs SGLang in the same environment: scripts/gpu/verl_session.md; vLLM
its own: scripts/gpu/vllm_session.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import add_settings_args, settings_from  # noqa: E402

from rlrun.config.schema import RecomputeMode  # noqa: E402
from rlrun.tools.bench.busy_processes import busy_processes  # noqa: E402
from rlrun.tools.bench.logged import run_logged  # noqa: E402
from rlrun.tools.bench.step import ATTENTION_SUFFIX, HEAD_SUFFIX, WARMUP_STEPS, StepSettings, Variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOALS = {"sglang": 4.0, "embedded": 2.5}
"""The goal against TRL: rlrun at least this many times faster than TRL per step."""
GOALS_VS_VERL = {"sglang": 1.5}
"""The goal against verl: rlrun with SGLang at least this many times faster than verl per step."""
VERL_VARIANTS = {"verl": "on", "verl_resident": "off"}
"""``--verl`` names and the ``--offload`` each runs benchmarks/verl_grpo.py with."""
TRL_VLLM_VARIANTS = {"trl_vllm": "on", "trl_vllm_resident": "off"}
"""``--trl-vllm`` names and the ``--offload`` (vLLM sleep mode) each runs benchmarks/trl_grpo.py with."""
PEERS = {"trl", *VERL_VARIANTS, *TRL_VLLM_VARIANTS}


def settings_flags(settings: StepSettings) -> list[str]:
    """The settings as the ``--flag value`` pairs both ``rlrun bench step`` and trl_grpo.py take."""
    return [
        arg
        for field in dataclasses.fields(StepSettings)
        if field.name != "backend"
        for arg in ("--" + field.name.replace("_", "-"), str(getattr(settings, field.name)))
    ]


def parse_variant(spec: str) -> tuple[str, Variant]:
    """``sglang_resident_keepnccl`` -> ("sglang", Variant(offload=False, teardown_nccl=False))."""
    backend, *suffixes = spec.split("_")
    attention = {suffix[1:]: name for name, suffix in ATTENTION_SUFFIX.items() if suffix}
    recompute = {f"recompute-{mode}": mode for mode in get_args(RecomputeMode) if mode != "none"}
    head = {suffix[1:]: name for name, suffix in HEAD_SUFFIX.items() if suffix}
    flags = {"resident", "keepnccl", "releasecache", "copywithweights", "optoffload"}
    unknown = set(suffixes) - {*flags, *attention, *head, *recompute}
    if unknown:
        raise SystemExit(
            f"--backends entry {spec!r} must be a backend plus _resident, _keepnccl, _releasecache, "
            f"_copywithweights, one of {sorted('_' + s for s in attention)}, one of "
            f"{sorted('_' + s for s in head)}, one of {sorted('_' + s for s in recompute)} and/or "
            f"_optoffload because those are the variants bench step runs; drop {sorted(unknown)}"
        )
    variant = Variant(
        offload="resident" not in suffixes,
        teardown_nccl="keepnccl" not in suffixes,
        release_cache="always" if "releasecache" in suffixes else "when_needed",
        optimizer_copy="with_weights" if "copywithweights" in suffixes else "overlapped",
        packed_attention=next((attention[s] for s in suffixes if s in attention), "auto"),
        recompute=next((recompute[s] for s in suffixes if s in recompute), "none"),
        optimizer_offload="optoffload" in suffixes,
        lm_head=next((head[s] for s in suffixes if s in head), "chunked"),
    )
    if variant.label(backend) != spec:
        raise SystemExit(
            f"--backends entry {spec!r} must be written {variant.label(backend)!r} (the run's folder name)"
        )
    return backend, variant


def variant_flags(backend: str, variant: Variant) -> list[str]:
    """The ``rlrun bench step`` flags of one variant."""
    return [
        "--backend",
        backend,
        "--offload",
        "on" if variant.offload else "off",
        "--teardown-nccl",
        "on" if variant.teardown_nccl else "off",
        "--release-cache",
        variant.release_cache,
        "--optimizer-copy",
        variant.optimizer_copy,
        "--packed-attention",
        variant.packed_attention,
        "--recompute",
        variant.recompute,
        "--optimizer-offload",
        "on" if variant.optimizer_offload else "off",
        "--lm-head",
        variant.lm_head,
    ]


def run_json(name: str, cmd: list[str], out: Path, timeout_s: float) -> dict:
    """Run ``cmd`` (which writes its JSON to ``out``); its output goes to ``out`` with ``.log``."""
    log = out.with_suffix(".log")
    code = run_logged(cmd, log, timeout_s, cwd=REPO)
    if code != 0 or not out.exists():
        return {"name": name, "command": " ".join(cmd), "error": f"exit {code}", "log_tail": log.read_text()[-3000:]}
    return json.loads(out.read_text())


def median_step_s(result: dict) -> float | None:
    """The median seconds per step of a ``bench step`` record or a trl_grpo.py record."""
    if "error" in result:
        return None
    body = result["results"][0] if "results" in result else result
    return body["median_step_s"]


def compare(results: dict[str, dict]) -> dict[str, dict]:
    """Per rlrun run: TRL s/step over rlrun s/step and whether it meets ``GOALS``, and the same against
    the verl run with the same offload (``verl_resident`` for a ``_resident`` run) for ``GOALS_VS_VERL``, and
    against the TRL-with-vLLM run with the same offload (no goal); a run gets the entries of the peers
    that ran."""
    trl = median_step_s(results["trl"]) if "trl" in results else None
    out = {}
    for backend, result in results.items():
        mine = median_step_s(result)
        if backend in PEERS or mine is None:
            continue
        kind = backend.split("_")[0]
        ratios: dict = {"rlrun_s_per_step": mine}
        if trl is not None:
            goal = GOALS.get(kind)
            ratios |= {"trl_s_per_step": trl, "speedup_vs_trl": trl / mine, "goal": goal}
            ratios["meets_goal"] = None if goal is None else ratios["speedup_vs_trl"] >= goal
        peer = "verl_resident" if "resident" in backend.split("_") else "verl"
        verl = median_step_s(results[peer]) if peer in results else None
        if verl is not None:
            goal = GOALS_VS_VERL.get(kind)
            ratios |= {"verl_run": peer, "verl_s_per_step": verl, "speedup_vs_verl": verl / mine, "goal_vs_verl": goal}
            ratios["meets_goal_vs_verl"] = None if goal is None else ratios["speedup_vs_verl"] >= goal
        peer = "trl_vllm_resident" if "resident" in backend.split("_") else "trl_vllm"
        trl_vllm = median_step_s(results[peer]) if peer in results else None
        if trl_vllm is not None:
            ratios |= {"trl_vllm_run": peer, "trl_vllm_s_per_step": trl_vllm, "speedup_vs_trl_vllm": trl_vllm / mine}
        if len(ratios) > 1:
            out[backend] = ratios
    return out


def with_goal(speedup: float | None, goal: float | None) -> str:
    """A table cell: the speedup and its goal, if the run has one."""
    if speedup is None:
        return ""
    return f"{speedup:.2f}" + ("" if goal is None else f" ({goal})")


def step_cell(body: dict) -> str:
    """The s/step cell; for rlrun (whose s/step sums its phases) also rank 0's wall clock between steps, which shows
    whether the phases cover the step (the peers' figures are their own whole-step timers)."""
    step = f"{body['median_step_s']:.2f}"
    return step + (f" (wall {body['median_wall_s']:.2f})" if "median_wall_s" in body else "")


def gap_cell(body: dict) -> str:
    """rlrun's largest trainer-vs-engine log-prob gap over the run's steps (nats a token; docs/on_policy.md): whether
    its engine was on-policy at this shape. Empty for the peers, which do not report one."""
    gap = body.get("max_logprob_gap")
    return "" if gap is None else f"{gap:.1e}"


def table(settings: StepSettings, results: dict[str, dict], ratios: dict[str, dict]) -> str:
    lines = [
        f"{settings.shape}: {settings.prompts} prompts x {settings.samples} samples, "
        f"{settings.new_tokens}-token responses, {settings.steps} steps (median after {WARMUP_STEPS} warm-up steps)",
        "| run | s/step | phases (median s) | output tok/s | x faster than TRL (goal) | x faster than verl (goal) "
        "| x faster than TRL+vLLM | max log-prob gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | failed: {result['error']} | | | | | | |")
            continue
        body = result["results"][0] if "results" in result else result
        ratio = ratios.get(name, {})
        vs_trl = with_goal(ratio.get("speedup_vs_trl"), ratio.get("goal"))
        vs_verl = with_goal(ratio.get("speedup_vs_verl"), ratio.get("goal_vs_verl"))
        vs_trl_vllm = with_goal(ratio.get("speedup_vs_trl_vllm"), None)
        phases = " ".join(f"{k} {v:.2f}" for k, v in body["median_phases_s"].items() if v >= 0.01)
        label = f"{name} (stopped early, {body['stopped_early']})" if "stopped_early" in body else name
        lines.append(
            f"| {label} | {step_cell(body)} | {phases} | {body['median_tokens_per_s']:.0f} | {vs_trl} "
            f"| {vs_verl} | {vs_trl_vllm} | {gap_cell(body)} |"
        )
    for name, result in results.items():
        busy = result.get("host_before", {}).get("busy_processes")
        if busy:
            shown = "; ".join(f"{p['command'][:60] or p['name']} ({p['pid']}) {p['cpu_fraction']}" for p in busy[:5])
            lines.append(f"busy before {name} (cores): {shown}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_settings_args(parser)
    parser.add_argument("--backends", default="embedded,sglang")
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--verl", default="", help=f"verl variants to run: {', '.join(VERL_VARIANTS)}.")
    parser.add_argument("--verl-python", default=sys.executable)
    parser.add_argument(
        "--verl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Passed to verl runs as --set (a Hydra override of verl's config, benchmarks/verl_grpo.py): to every "
        "one, or to one variant as VARIANT:KEY=VALUE (e.g. verl_resident:actor_rollout_ref.actor."
        "ppo_max_token_len_per_gpu=10240, where the resident run alone runs out of memory).",
    )
    parser.add_argument(
        "--verl-replay-poll-s",
        type=float,
        default=None,
        help="Passed to every verl run as --replay-poll-s (its trainer's wait for a rollout; verl_grpo.py's default "
        "when not given).",
    )
    parser.add_argument(
        "--trl-vllm", default="", help=f"TRL-with-vLLM variants to run: {', '.join(TRL_VLLM_VARIANTS)}."
    )
    parser.add_argument("--trl-vllm-python", default=sys.executable)
    parser.add_argument(
        "--reuse-trl-vllm",
        default="",
        help="TRL-with-vLLM variants whose results come from --work/<variant>.json (earlier invocations, same "
        "settings) instead of running them.",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL only (rlrun does not recompute).")
    parser.add_argument(
        "--reuse-trl",
        action="store_true",
        help="Take TRL's result from --work/trl.json (an earlier invocation, same settings) instead "
        "of running it again: for variant runs split over several device calls.",
    )
    parser.add_argument(
        "--no-trl",
        action="store_true",
        help="Run no TRL (to compare rlrun with verl or TRL+vLLM only): the record has no TRL ratios.",
    )
    parser.add_argument(
        "--reuse-verl",
        default="",
        help="verl variants whose results come from --work/<variant>.json (earlier invocations, same settings) "
        "instead of running them: the record then holds every peer's row.",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="Per run.")
    parser.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="rlrun runs only: profile this step (its train phase's top ops go into the JSON).",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = settings_from(args, "trl")
    args.work.mkdir(parents=True, exist_ok=True)
    flags = settings_flags(settings) + ["--work", str(args.work)]
    # TRL first: the reference survives if a later run (SGLang's start-up is the slowest) runs out of time
    runs = {
        "trl": [args.trl_python, str(REPO / "benchmarks" / "trl_grpo.py"), *flags, "--out", str(args.work / "trl.json")]
        + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    }
    verl = names(args.verl, "--verl")
    for name in verl:
        runs[name] = [
            args.verl_python,
            str(REPO / "benchmarks" / "verl_grpo.py"),
            *flags,
            "--offload",
            VERL_VARIANTS[name],
            *(arg for item in verl_overrides(args.verl_set, name) for arg in ("--set", item)),
            *([] if args.verl_replay_poll_s is None else ["--replay-poll-s", str(args.verl_replay_poll_s)]),
            "--timeout-s",
            str(args.timeout_s),
            "--out",
            str(args.work / f"{name}.json"),
        ]
    trl_vllm = names(args.trl_vllm, "--trl-vllm", TRL_VLLM_VARIANTS)
    profile = [] if args.profile_step is None else ["--profile-step", str(args.profile_step)]
    for spec in [b.strip() for b in args.backends.split(",") if b.strip()]:
        runs[spec] = [
            sys.executable,
            "-m",
            "rlrun",
            "bench",
            "step",
            *variant_flags(*parse_variant(spec)),
            *flags,
            *profile,
            "--out",
            str(args.work / f"rlrun_{spec}.json"),
            "--timeout-s",
            str(args.timeout_s),
        ]
    # TRL with vLLM last: no goal is set against it, so a run that ends early keeps verl's and rlrun's rows
    for name in trl_vllm:
        runs[name] = [
            args.trl_vllm_python,
            str(REPO / "benchmarks" / "trl_grpo.py"),
            *flags,
            "--use-vllm",
            "--offload",
            TRL_VLLM_VARIANTS[name],
            "--out",
            str(args.work / f"{name}.json"),
        ] + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    results: dict[str, dict] = {}
    if args.no_trl and args.reuse_trl:
        raise SystemExit("--no-trl and --reuse-trl must not be given together because one drops TRL; drop one")
    if args.no_trl:
        del runs["trl"]
    if args.reuse_trl:
        results["trl"] = reused_result(args.work / "trl.json", settings, "--reuse-trl")
        del runs["trl"]
    reuses = (
        (args.reuse_verl, "--reuse-verl", "--verl", VERL_VARIANTS, verl),
        (args.reuse_trl_vllm, "--reuse-trl-vllm", "--trl-vllm", TRL_VLLM_VARIANTS, trl_vllm),
    )
    for spec, flag, run_flag, variants, running in reuses:
        for name in names(spec, flag, variants):
            if name in running:
                raise SystemExit(f"{name!r} must be in {run_flag} or in {flag}, not both; drop one")
            results[name] = reused_result(args.work / f"{name}.json", settings, flag)
    for name, cmd in runs.items():
        # what used the CPU just before: a host-bound peer (vLLM's scheduler) pays for a leftover or a neighbour
        host = busy_processes()
        results[name] = run_json(name, cmd, Path(cmd[cmd.index("--out") + 1]), args.timeout_s + 60)
        results[name]["host_before"] = host
        write_record(args.out, settings, results)  # after every run: a later timeout keeps what finished
    print(table(settings, results, compare(results)))


def names(spec: str, flag: str, variants: dict[str, str] = VERL_VARIANTS) -> list[str]:
    """The peer variants (verl's by default) a comma-separated ``flag`` value names."""
    listed = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(listed) - set(variants))
    if unknown:
        raise SystemExit(f"{flag} ({spec}) must name variants from {sorted(variants)}; drop {unknown}")
    return listed


def verl_overrides(items: list[str], variant: str) -> list[str]:
    """The ``--verl-set`` items for one verl variant: the unprefixed ones and those prefixed ``variant:``. A prefix
    that names no variant is refused (a typo would otherwise drop the override silently)."""
    chosen = []
    for item in items:
        prefix, sep, rest = item.partition(":")
        if sep and "=" not in prefix:
            if prefix not in VERL_VARIANTS:
                raise SystemExit(f"--verl-set {item}: {prefix!r} is not a verl variant ({sorted(VERL_VARIANTS)})")
            if prefix == variant:
                chosen.append(rest)
        else:
            chosen.append(item)
    return chosen


def reused_result(path: Path, settings: StepSettings, flag: str) -> dict:
    """An earlier invocation's peer record (TRL's or a verl variant's), if it ran the same work (marked
    ``reused_from``)."""
    if not path.exists():
        raise SystemExit(
            f"{flag} needs {path} because it takes the peer's figures from there; run without "
            f"{flag} first (same --work) or drop the flag"
        )
    record = json.loads(path.read_text())
    ran = {k: v for k, v in record.get("settings", {}).items() if k != "backend"}
    wanted = {k: v for k, v in dataclasses.asdict(settings).items() if k != "backend"}
    if ran != wanted:
        raise SystemExit(
            f"{flag}: {path} ran {ran}, this invocation wants {wanted}; they must match "
            f"because the ratios compare the same work; drop {flag}"
        )
    return {**record, "reused_from": str(path)}


def write_record(path: Path, settings: StepSettings, results: dict[str, dict]) -> None:
    record = {
        "benchmark": "peer_step",
        "command": "python " + " ".join(sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "backend"},
        "ratios": compare(results),
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
