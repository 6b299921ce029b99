"""A rollout function (``rollout.rollout_fn``, slime's ``--rollout-function-path``): groups of mixed length budgets.

    rollout:
      rollout_fn: examples/hooks/rollout_fn.py:mixed_budgets

Each group's first half is generated with half of ``rollout.max_new_tokens`` and its second half with all of
it, in two engine calls per round (rlrun's own generation, ``ctx.generate``, with changed settings and its
own seed for each call). Within a group the short answers then compete with the long ones, a simple length
curriculum. The groups go on to ``rollout.reward``, the filter and training as rlrun's own would.
Interface: rlrun/rollout/rollout_fn.py.
"""

from __future__ import annotations


def mixed_budgets(ctx):
    n = ctx.config.samples_per_prompt
    num_short = n // 2
    short_cfg = ctx.config.model_copy(
        update={"samples_per_prompt": num_short, "max_new_tokens": max(1, ctx.config.max_new_tokens // 2)}
    )
    long_cfg = ctx.config.model_copy(update={"samples_per_prompt": n - num_short})
    short = ctx.generate(ctx.prompts, short_cfg, seed=ctx.seed) if num_short else []
    long = ctx.generate(ctx.prompts, long_cfg, seed=ctx.seed + 1)
    # ctx.generate returns prompt-major samples: prompt i's are a contiguous run.
    return [
        short[i * num_short : (i + 1) * num_short] + long[i * (n - num_short) : (i + 1) * (n - num_short)]
        for i in range(len(ctx.prompts))
    ]
