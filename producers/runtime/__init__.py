"""What every rlstream process runs with, whatever its layer: the Prometheus metrics registry and
exporter (``metrics``) and the event loop of the HTTP services (``aio``). They import nothing of
ours and live in ``producers``, the lowest layer that runs processes, so that every layer above
may use them."""
