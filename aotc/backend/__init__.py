"""Entry 3: aotc as a ``torch.compile`` backend (``torch.compile(model, backend="aotc")`` or
``backend=aotc.backend(...)``): a graph in, a stored program out. :mod:`aotc.backend.serve` is the
front door (key, hit or miss, the safety net), :mod:`aotc.backend.build` the miss, the rest helpers.

The public function is :func:`aotc.backend` (a plain function in ``aotc/__init__.py``); this
package holds no code so that importing it is free.
"""
