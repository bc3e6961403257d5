"""Layer 2: in-step recovery (flat fp32 gradient buckets, snapshots keyed by step and world epoch)."""

from nanotron_recover.training.buckets import GradBuckets

__all__ = ["GradBuckets"]
