"""Drafter training: target-response data, packed objectives, the training loop, offline
acceptance length, progressive layer pruning and online evaluation (see docs/training.md)."""
