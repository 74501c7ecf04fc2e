"""The offset ledger under the stages: per-assignment offset tracking (an input is done once its
result or dead-letter record is acknowledged), the committers, and the two processing guarantees
(at-least-once commits, exactly-once transactions)."""
