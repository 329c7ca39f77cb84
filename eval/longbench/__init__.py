"""The LongBench harness: official prompts and metrics, data, the keep-ratio sweep, the report."""
