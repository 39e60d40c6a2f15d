"""The learner side's settings: GRPO, the supervised warm start and the learner role, as pydantic
models, apart from the torch code that runs them (see ``rollout.config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlstream.envs import fx_tasks as tasks
from rlstream.rollout.config import PolicyConfig, task_policy
from rlstream.schemas.derive import LOCAL, derive


class Overlong(BaseModel):
    """How samples cut by the token budget are trained."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["keep", "mask", "penalty"] = Field(
        "keep", description="keep: as any sample; mask: no loss; penalty: DAPO's soft penalty."
    )
    end_ids: tuple[int, ...] = Field(
        (2, 4), description="Token ids that end a sample normally (the char vocab's EOS, RUN_END)."
    )
    max_len: int = Field(48, ge=1, description="Generated-token budget the penalty is measured to.")
    soft: int = Field(8, ge=1, description="Tokens before max_len where the penalty ramps up.")


class _Objective(BaseModel):
    """Settings every objective has (see ``trainer.objectives`` for the rules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kl_coef: float = Field(0.0, ge=0, le=10, description="Weight of the KL to the reference (v0).")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator per token.")
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Weight of the entropy bonus.")
    overlong: Overlong = Field(default_factory=Overlong, description="Over-long samples.")
    minibatches: int = Field(1, ge=1, le=64, description="Optimizer steps per version.")


class TruncatedIS(_Objective):
    """Token-level GRPO with truncated importance weights (the default)."""

    kind: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0, description="C in min(exp(logp_cur - logp_beh), C).")
    minibatches: int = Field(
        1, ge=1, le=1, description="One step per version: the weight bounds no trust region."
    )


class DecoupledPPO(_Objective):
    """AReaL's decoupled PPO: clip against the proximal, weigh against the behaviour."""

    kind: Literal["decoupled_ppo"] = "decoupled_ppo"
    eps_low: float = Field(0.2, gt=0, lt=1, description="Lower clip of r_prox.")
    eps_high: float = Field(0.28, gt=0, le=10, description="Upper clip of r_prox.")
    cap: float = Field(5.0, gt=0, description="Cap of the behaviour weight pi_prox / pi_beh.")


class GSPO(_Objective):
    """Sequence-level, length-normalised, clipped ratio."""

    kind: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-3, gt=0, lt=1, description="Lower clip of the sequence ratio.")
    eps_high: float = Field(4e-3, gt=0, le=10, description="Upper clip of the sequence ratio.")


class CISPO(_Objective):
    """Clipped, detached IS weight; every token keeps its gradient."""

    kind: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, gt=0, le=1, description="Lower clip (1: no lower bound).")
    eps_high: float = Field(0.28, gt=0, le=10, description="Upper clip of the IS weight.")


class MaskedIS(_Objective):
    """Token masking of the off-policy gap (MIS / IcePop band)."""

    kind: Literal["masked_is"] = "masked_is"
    low: float = Field(0.5, ge=0, lt=1, description="Tokens with r_beh below this are masked.")
    high: float = Field(2.0, gt=1, description="Tokens with r_beh above this are masked.")


LossConfig = Annotated[
    TruncatedIS | DecoupledPPO | GSPO | CISPO | MaskedIS, Field(discriminator="kind")
]
OBJECTIVES = ("tis", "decoupled_ppo", "gspo", "cispo", "masked_is")


class GrpoConfig(BaseModel):
    """Learner-side GRPO settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adv_eps: float = Field(default=1e-6, gt=0, description="eps in (r - mean) / (std + eps).")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Global gradient-norm clip.")
    temperature: float = Field(
        default=1.0, gt=0, description="Temperature the behaviour sampled at."
    )
    router_replay: bool = Field(
        default=True, description="Force the recorded experts when recomputing."
    )
    pack_tokens: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Pack samples into rows of this many tokens (at least the longest sample) "
        "for the learner's forward passes; 0: right-pad every sample to the longest.",
    )


#: The warm start's steps for the built-in model, which starts from random weights.
FROM_SCRATCH_STEPS = 300


class WarmStartConfig(BaseModel):
    """Supervised warm-start settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Optimizer steps on the fx family's demonstrations before RL. None (auto): "
        f"{FROM_SCRATCH_STEPS} for the built-in model trained from scratch, 0 (off) for a model "
        "of `policy.hf_dir`: a pretrained checkpoint is never fine-tuned on the demo's toy "
        "tasks unless a number is set here.",
    )
    batch_size: int = Field(default=48, ge=1, le=4096, description="Demonstrations per step.")
    lr: float = Field(
        default=1e-2, gt=0, le=1, description="Adam learning rate (linear warm-up, 20 steps)."
    )
    balance_coef: float = Field(default=0.01, ge=0, le=1, description="Load-balancing loss weight.")
    seed: int = Field(default=0, ge=0, description="Seed of task sampling and demonstrations.")
    teacher: tasks.TeacherConfig = Field(
        default_factory=tasks.TeacherConfig, description="Reliability of the demonstrations."
    )
    task: tasks.TaskConfig = Field(
        default_factory=tasks.TaskConfig, description="Task family difficulty."
    )

    def resolved(self, policy: PolicyConfig) -> WarmStartConfig:
        """These settings with ``steps`` decided for ``policy`` (see ``steps``)."""
        if self.steps is not None:
            return self
        return derive(self, steps=0 if policy.hf_dir is not None else FROM_SCRATCH_STEPS)


class LearnerConfig(BaseModel):
    """Config of the learner role."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("policy", description="Model name (weights.manifests key).")
    policy: PolicyConfig = Field(
        default_factory=task_policy,
        description="Policy shape.",
    )
    warm_start: WarmStartConfig = Field(
        default_factory=WarmStartConfig, description="Supervised warm start before RL (version 0)."
    )
    grpo: GrpoConfig = Field(default_factory=GrpoConfig, description="GRPO rules.")
    loss: LossConfig = Field(
        default_factory=TruncatedIS,
        description="The objective (trainer.objectives): tis, decoupled_ppo, gspo, cispo, "
        "masked_is; with its KL, entropy, over-long and minibatch settings.",
    )
    lr: float = Field(5e-4, gt=0, le=1, description="Adam learning rate.")
    groups_per_step: int = Field(4, ge=1, description="Admitted groups per optimizer step (B).")
    mix_online_groups: int = Field(1, ge=0, description="Online (feedback) groups allowed ...")
    mix_rollout_groups: int = Field(
        0, ge=0, description="... per this many rollout groups trained; 0 = no limit."
    )
    keyframe_every: int = Field(8, ge=1, description="A keyframe every K versions.")
    fast_apply_deltas: bool = Field(
        False,
        description="Code weight deltas for fast applies (direct pieces: larger, applied at a"
        " cost that follows the change and checked without hashing; docs/benchmarks.md).",
    )
    max_versions: int = Field(1_000_000, ge=1, description="Stop after publishing this version.")
    publish_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Dtype of published weights."
    )
    state_dir: str = Field(
        default_factory=lambda: str(Path.home() / ".local/state/rlstream/learner"),
        description="Folder of the learner's checkpoints (STATE_DIR/RUN/v*.pt: fp32 weights and "
        "optimizer state) and, when it makes one, the run's signing key; made absolute when "
        "read, so a learner restarted from another directory finds them.",
        json_schema_extra=LOCAL,
    )
    checkpoint_every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="Checkpoint every N versions (the last 3 kept). A learner restarted past "
        "its last checkpoint takes the published weights (publish_dtype) of the last version "
        "and a fresh optimizer state.",
    )
    insecure_weights: bool = Field(
        False,
        description="Create the run INSECURE: publish weight manifests unsigned; the launcher "
        "gives every role that choice ($RLSTREAM_WEIGHTS_INSECURE) and pins it on its host, so "
        "that readers accept them (said loudly in every log; never read from a record). "
        "Default: the run has a signing key from its creation and readers refuse what it did "
        "not sign.",
    )
    warm_start_cache: str | None = Field(
        None, description="Cache file of the warm-start weights.", json_schema_extra=LOCAL
    )
    seed: int = Field(0, ge=0, description="torch seed of the learner.")

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_kind_defaults(cls, value: Any) -> Any:
        """A loss table without ``kind`` tunes the default objective (``--set
        learner.loss.entropy_coef=0.01`` alone), rather than failing to pick a variant."""
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": TruncatedIS().kind, **value}
        return value

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().absolute())

    ranks: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks on torch.distributed (rlstream run learner --ranks N); "
        "under torchrun, WORLD_SIZE decides. Each step's groups are split over the ranks, so "
        "groups_per_step must be at least this.",
        json_schema_extra=LOCAL,
    )
