"""What torch loads for ``torch.compile(model, backend="aotc")``: the ``torch_dynamo_backends``
entry point. torch imports this module when a caller names the backend (its registry's lookup,
at the ``torch.compile`` call, not when backends are listed), so a compile of that caller's is
about to start: the kernels' precompiled header and the ISA probes are started here
(:func:`aotc.backend.serve.start_kernel_header`: on a CPU machine that lacks them, for a store
that has not served this toolchain, each g++ run at the lowest priority), not at Dynamo's start
callback — at the 0.5B bench model that is ~0.4 s earlier, and the header is what the compile's
kernels wait for. Dynamo's end callback kills what still runs, as before, and so does the
interpreter's exit.
"""

from __future__ import annotations

from aotc.backend.serve import aotc_backend, start_kernel_header

__all__ = ["aotc_backend"]

start_kernel_header()
