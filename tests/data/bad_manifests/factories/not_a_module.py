"""A factory for tests/test_bad_manifests.py that returns something other than an nn.Module."""


def build() -> int:
    return 42
