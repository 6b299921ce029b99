"""The trainer: what one rank runs, step by step (``loop``), and the parts it holds.

    loop.py        run, the step as a dozen named phases
    components.py  ``Components`` (what a rank holds) and ``setup``; the batch scatter and sync schedule of both loops
    ahead_step.py  the step when rollouts are generated ahead (``rollout.max_staleness`` > 0)
    actor.py       ``Actor``: the policy model, optimizer and LR schedule; prepare / train / export / checkpoint
    batch.py       ``TrainBatch``: rank 0's plan of every rank's updates, micro-batches and global counts
    roles.py       reference / teacher / old-actor weights as CPU backups swapped into the one model
    critic.py      PPO's critic on the actor's ranks
    offload.py     trainer / engine turn-taking on device memory, the step's phases and memory timeline
    checkpoint.py  atomic run checkpoints (``RunState``), resume, pruning, async save

Importing the package imports nothing heavy; import the modules.
"""
