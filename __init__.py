"""rlstream: the Kafka event backbone for asynchronous distributed RL of agentic coding models.

The repository root is the ``rlstream`` package; its top-level folders are the layers, and imports
point one way only: ``schemas`` <- ``producers``/``consumers`` <- ``envs``/``rollout``/``trainer``
<- ``ops``. This module stays import-light so ``rlstream --help`` starts fast.
"""

__version__ = "0.1.0"
