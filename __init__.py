"""rlstream: the Kafka event backbone for asynchronous distributed RL of agentic coding models.

The repository root is the ``rlstream`` package; each top-level folder is one layer, and imports
point one way only: ``schemas`` <- ``producers`` <- ``consumers`` <- ``envs`` <- ``rollout`` <-
``trainer`` <- ``ops`` (a module imports its own folder or lower ones). This module stays
import-light so ``rlstream --help`` starts fast.
"""

__version__ = "0.1.0"
