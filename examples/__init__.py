"""Examples of user pipelines (see docs/)."""
