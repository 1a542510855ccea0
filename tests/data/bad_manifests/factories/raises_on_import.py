"""A factory module for tests/test_bad_manifests.py whose import fails."""

raise RuntimeError("this factory module refuses to import")
