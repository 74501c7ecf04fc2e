"""Output, the last stage: results encoded in cut order and produced (``acks=all``), dead-letter
records, and the delivery reports that mark inputs done in the offset ledger."""
