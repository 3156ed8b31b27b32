"""Many ranks, one model: FSDP2 sharding (``sharding``), reading a checkpoint's tensors straight into
shards (``sharded_loading``), sharded checkpoints written atomically (``sharded_checkpoint``), and
what the ranks do together under any strategy (``ranks``: reductions, gradient sync held back),
and ``stop_children`` (under Lightning's launcher, a failing rank 0 kills the ranks it started).
May import ``ppo/`` (to cut micro-batches alike on every rank), ``runs/`` and ``config``.
"""
