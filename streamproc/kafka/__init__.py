"""The seam to Kafka: the client protocols streamproc uses (where tests put fakes), building the
clients, topic administration, consumer lag, and retrying transient broker errors."""
