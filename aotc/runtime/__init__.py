"""The warm start: lookup → read and verify → rehydrate → bind → run (``aotc.load``), and
CUDA graphs as a wrapper around the runner. Never imports :mod:`aotc.compile`."""
