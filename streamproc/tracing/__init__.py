"""OpenTelemetry traces of the record path, across Kafka.

A record's journey stays one trace although streamproc runs many records in one model call:

* **in** (:mod:`.context`): a W3C ``traceparent`` (and ``tracestate``) header on an input record
  is its parent context; a malformed one is ignored and counted, never the record's fault;
* **the batch** (:mod:`.batch`): one ``process <topic>`` span per batch (kind ``CONSUMER``;
  messaging semantic conventions: operation ``process``, batch size, topic, partitions), a
  child of the first sampled record context of the batch (else a root, sampled at
  ``tracing.sample_ratio``), with one link per record context (at most ``tracing.max_links``)
  and child spans for the batch's stages: ``decode``, ``device.wait`` and ``device`` (the
  measured device time of the model call, not its launch), ``encode`` and ``produce`` (first
  produce call to the last acknowledgement);
* **out** (:mod:`.batch`): every result and dead-letter record of a record with a context
  carries a ``traceparent`` of its own: a ``create <output topic>`` span (kind ``PRODUCER``),
  a child of the input's context and linked to the batch span, so a downstream consumer
  continues the same trace; one of a record without a context in a batch sampled as a root
  (none of its records had a context) carries the batch span's, and in any other batch none (a
  record without a context never joins another record's trace);
* **exemplars**: the latency histograms carry the batch's trace id where a sampled trace
  exists (:mod:`streamproc.histograms`, OpenMetrics exposition);
* **export** (:mod:`.export`): OTLP over HTTP (protobuf) from a bounded queue on the SDK's
  export thread: a backend that is down or slow costs the hot path nothing, and what it could
  not take is counted (``streamproc_trace_spans_dropped_total{reason}``).

With tracing off (``tracing.enabled: false`` or no endpoint) nothing of this runs: the stage
clocks carry no trace and no header is read.
"""
