"""Carrying one build to many machines: bundles, signatures and trust, the S3 remote store,
push and pull."""
