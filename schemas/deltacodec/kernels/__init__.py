"""The delta codec's numba kernels, one module per coder, at module level so that numba's
on-disk cache (``__pycache__`` beside each module) serves every process after the first. They
are imported on first use only, so that importing the codec stays cheap; ``rlstream delta warm``
compiles them all once."""
