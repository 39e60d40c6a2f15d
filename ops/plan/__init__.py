"""Sizing a deployment past these machines (``rlstream plan``): one version's journey from the
learner to every engine, stage by stage, from rates measured here (``rlstream bench plan``)
and hardware figures given for the deployment. The model: ``ops.plan.model``."""
