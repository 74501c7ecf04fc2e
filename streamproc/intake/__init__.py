"""Intake, the first stage: the source thread that owns the consumer and its rebalances, the
per-partition rings with pause/resume watermarks, and each lane's batcher policy."""
