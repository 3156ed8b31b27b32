"""Many ranks, one model: FSDP2 sharding (``sharding``), reading a checkpoint's tensors straight into
shards (``sharded_loading``) and sharded checkpoints written atomically (``sharded_checkpoint``).
May import ``ppo/`` (to cut micro-batches alike on every rank), ``runs/`` and ``config``.
"""
