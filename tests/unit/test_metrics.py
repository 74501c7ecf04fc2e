"""The process metrics: one registry per :class:`Metrics`, series read through it."""

from __future__ import annotations

from streamproc.metrics import Metrics


def test_counter_value_reads_a_series_through_the_registry() -> None:
    metrics = Metrics()
    assert metrics.counter_value(metrics.consumed, topic="t") == 0.0  # no series yet
    metrics.child(metrics.consumed, "t").inc(3)
    metrics.consumed.labels("t").inc(2)
    metrics.dead_lettered.labels("t", "decode").inc()
    assert metrics.counter_value(metrics.consumed, topic="t") == 5.0
    assert metrics.counter_value(metrics.consumed, topic="other") == 0.0
    assert metrics.counter_value(metrics.dead_lettered, topic="t", stage="decode") == 1.0
    assert metrics.counter_value(metrics.dead_lettered, topic="t", stage="model") == 0.0


EXPOSED = [  # name and type of every family, in registration order (operators' dashboards)
    ("streamproc_messages_consumed", "counter"),
    ("streamproc_messages_read_again", "counter"),
    ("streamproc_messages_produced", "counter"),
    ("streamproc_produce_retries", "counter"),
    ("streamproc_messages_dead_lettered", "counter"),
    ("streamproc_expired", "counter"),
    ("streamproc_deadline_header_invalid", "counter"),
    ("streamproc_batch_size_messages", "histogram"),
    ("streamproc_queue_wait_seconds", "histogram"),
    ("streamproc_inference_seconds", "histogram"),
    ("streamproc_end_to_end_seconds", "histogram"),
    ("streamproc_latency_p99_seconds", "gauge"),
    ("streamproc_latency_target_seconds", "gauge"),
    ("streamproc_latency_over_target_seconds", "counter"),
    ("streamproc_stage_seconds", "histogram"),
    ("streamproc_ring_fill_ratio", "gauge"),
    ("streamproc_paused_partitions", "gauge"),
    ("streamproc_unacknowledged_bytes", "gauge"),
    ("streamproc_unacknowledged_wait_seconds", "counter"),
    ("streamproc_commits", "counter"),
    ("streamproc_commit_failures", "counter"),
    ("streamproc_transaction_aborts", "counter"),
    ("streamproc_producer_renewals", "counter"),
    ("streamproc_late_results", "counter"),
    ("streamproc_share_in_flight_records", "gauge"),
    ("streamproc_share_busy_ratio", "gauge"),
    ("streamproc_share_acknowledged", "counter"),
    ("streamproc_share_released", "counter"),
    ("streamproc_share_acknowledgement_failures", "counter"),
    ("streamproc_share_acquired_end_offset", "gauge"),
    ("streamproc_partition_end_offset", "gauge"),
    ("streamproc_share_redelivered", "counter"),
    ("streamproc_pinned_pool_in_use_buffers", "gauge"),
    ("streamproc_pinned_pool_capacity_buffers", "gauge"),
    ("streamproc_pinned_pool_allocations", "gauge"),
    ("streamproc_pool_leaked_buffers", "gauge"),
    ("streamproc_device_batches", "counter"),
    ("streamproc_device_in_flight_batches", "gauge"),
    ("streamproc_device_busy_seconds", "counter"),
    ("streamproc_device_stalled", "gauge"),
    ("streamproc_device_deferred_launches", "counter"),
    ("streamproc_device_yielded_launches", "counter"),
    ("streamproc_results_waiting_batches", "gauge"),
    ("streamproc_model_retry_calls", "counter"),
    ("streamproc_model_isolated_rows", "counter"),
    ("streamproc_model_broken_batches", "counter"),
    ("streamproc_model_held", "gauge"),
    ("streamproc_device_out_of_memory", "counter"),
    ("streamproc_batch_size_cap", "gauge"),
    ("streamproc_model_serving", "gauge"),
    ("streamproc_model_batches", "counter"),
    ("streamproc_model_fallback_batches", "counter"),
    ("streamproc_model_swaps", "counter"),
    ("streamproc_model_refused_versions", "counter"),
    ("streamproc_model_rollbacks", "counter"),
    ("streamproc_model_swap_pause_seconds", "histogram"),
    ("streamproc_shadow_batches", "counter"),
    ("streamproc_shadow_errors", "counter"),
    ("streamproc_shadow_agreement_ratio", "gauge"),
    ("streamproc_shadow_latency_ratio", "gauge"),
    ("streamproc_decode_workers", "gauge"),
    ("streamproc_decode_wait_ratio", "gauge"),
    ("streamproc_lane_fused", "gauge"),
    ("streamproc_decode_inline", "gauge"),
    ("streamproc_consumer_lag_messages", "gauge"),
    ("streamproc_consumer_lag_seconds", "gauge"),
    ("streamproc_stalled_partitions", "gauge"),
    ("streamproc_gpu_utilization_ratio", "gauge"),
    ("streamproc_gpu_memory_used_bytes", "gauge"),
    ("streamproc_trace_context_invalid", "counter"),
    ("streamproc_trace_links_dropped", "counter"),
    ("streamproc_trace_spans_exported", "counter"),
    ("streamproc_trace_spans_dropped", "counter"),
]


def test_every_metric_family_keeps_its_name_and_type() -> None:
    families = Metrics().registry.collect()
    assert [(family.name, family.type) for family in families] == EXPOSED
