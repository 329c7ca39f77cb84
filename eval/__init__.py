"""Evaluation harnesses (LongBench score versus latency over keep ratios)."""
