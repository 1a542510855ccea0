"""Every use of a private torch API (``torch._inductor``, ``torch._dynamo``, ``torch._guards``,
``torch._ops``, ``torch._C._dynamo``), each behind our own functions; each module names the torch
versions it was tested on. The runtime imports only the load side (``inductor_load``, ``wrapper``,
``ops``)."""
