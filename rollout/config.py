"""The rollout side's settings: the policy's shape, the harness, rollout workers and the eval
role, as pydantic models.

They live apart from the code that runs them so that reading a recipe (``ops.run.config``) imports
neither torch nor transformers: roles that never touch the policy (admission, judges, the
scheduler) start in a fraction of a second and stay small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlstream.envs import fx_tasks as task_family
from rlstream.envs import protocol, sandbox
from rlstream.envs.family import FamilySpec
from rlstream.schemas.derive import LOCAL


class LoraConfig(BaseModel):
    """Low-rank adapters (peft LoRA) trained instead of the full weights during RL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(
        default=0, ge=0, le=1024, description="Adapter rank r; 0: no adapters, train everything."
    )
    alpha: int = Field(default=16, ge=1, le=4096, description="Scale alpha (update x alpha/r).")
    targets: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Linear modules given adapters (the experts are fused tensors, not linears).",
    )
    lr_scale: float = Field(
        default=10.0, gt=0, le=1000, description="Adapters learn at learner.lr x this."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the adapters' A initialisation.")


#: Dense causal LM types the policy adapter (``rollout.hf_policy``) was checked on, each as a tiny
#: model of its own config (tests/unit/test_dense_policy.py): no router, nothing to replay.
DENSE_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
     "smollm3"}
)  # fmt: skip
#: Sparse types whose routers are recorded and replayed (``rollout.hf_policy.ReplayMoeBlock``).
MOE_MODEL_TYPES = frozenset({"qwen3_moe"})
#: Any one of these makes a folder's tokenizer loadable without a download.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str) -> str:
    """``path`` if it is a local model folder the policy adapter can drive; else ``ValueError``
    saying what is wrong (read from its ``config.json`` alone: no torch, no transformers)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"{path}: no such folder (a local Hugging Face model folder; `rlstream model "
            "import` makes one from a GGUF file)"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no readable config.json ({exc})") from None
    kind = config.get("model_type")
    if kind not in DENSE_MODEL_TYPES | MOE_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {kind!r} is not one the policy adapter was checked on "
            f"(dense: {', '.join(sorted(DENSE_MODEL_TYPES))}; with router replay: "
            f"{', '.join(sorted(MOE_MODEL_TYPES))})"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the model's own "
            "tokenizer and chat template are used, never a stand-in"
        )
    return str(folder.resolve())


#: The architectures built from the shape fields (no ``hf_dir``).
BUILT_IN = ("qwen3_moe", "llama")


class PolicyConfig(BaseModel):
    """Architecture and shape of the policy network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str = Field(
        default="qwen3_moe",
        description="The model built from the shape fields below when there is no `hf_dir`: "
        "`qwen3_moe` (a transformers Qwen3-MoE, every layer sparse, routes recorded and replayed) "
        "or `llama` (a dense transformers Llama, no router: nothing to replay; `d_expert` is its "
        "MLP width). With `hf_dir` it is the folder's own `model_type`, set from its "
        "config.json (so the run's record says what trained: a dense type has no routes).",
    )
    hf_dir: str | None = Field(
        default=None,
        description="Local HF directory to load; its config then decides the "
        "shape and the shape fields below are not used. Never downloaded.",
        json_schema_extra=LOCAL,
    )

    vocab_size: int = Field(default=128, ge=2, le=65536, description="Token vocabulary size.")
    max_seq_len: int = Field(default=256, ge=8, le=8192, description="Context window in tokens.")
    d_model: int = Field(default=64, ge=8, le=4096, description="Residual stream width.")
    n_heads: int = Field(
        default=4, ge=1, le=64, description="Attention heads (must divide d_model)."
    )
    head_dim: int | None = Field(
        default=None,
        ge=4,
        le=512,
        description="Width of one attention head (None: d_model / n_heads). vLLM's CPU "
        "attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512 only.",
    )
    n_layers: int = Field(
        default=2, ge=1, le=48, description="Transformer blocks, each with an MoE FFN."
    )
    n_experts: int = Field(
        default=4,
        ge=2,
        le=65536,
        description="Experts per MoE layer (ids are recorded as uint8 up to 256, else uint16).",
    )
    top_k: int = Field(default=2, ge=1, le=8, description="Experts each token is routed to.")
    d_expert: int = Field(
        default=128, ge=4, le=16384, description="Hidden width of one expert MLP."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the weight initialisation.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters: the base is the warm start, RL trains (and versions carry) "
        "the adapters only.",
    )

    def head_size(self) -> int | None:
        """Width of one attention head (None: decided by ``hf_dir``'s config)."""
        if self.hf_dir is not None:
            return None
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @field_validator("hf_dir")
    @classmethod
    def _usable_folder(cls, value: str | None) -> str | None:
        return None if value is None else check_model_dir(value)

    @model_validator(mode="before")
    @classmethod
    def _architecture(cls, data: object) -> object:
        """The folder's model type when there is ``hf_dir``; else one of the built-in ones."""
        if not isinstance(data, dict):
            return data
        value = data.get("architecture", "qwen3_moe")
        if value == "rlstream-moe":
            raise ValueError(
                "the homemade `rlstream-moe` policy was removed; use policy.architecture = "
                '"qwen3_moe" (a Hugging Face Qwen3-MoE of the same shape fields)'
            )
        if data.get("hf_dir"):
            folder = Path(str(data["hf_dir"])).expanduser()
            try:
                kind = json.loads((folder / "config.json").read_text()).get("model_type")
            except (OSError, ValueError):
                return data  # the hf_dir check says what is wrong
            return {**data, "architecture": kind}
        if value not in BUILT_IN:
            raise ValueError(
                f"policy.architecture {value!r}: without hf_dir one of {', '.join(BUILT_IN)} "
                "is built; your own model goes in policy.hf_dir"
            )
        return data


class HarnessConfig(BaseModel):
    """How one sample is rolled out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=64, ge=1, le=4096, description="Token budget of one turn.")
    max_turns: int = Field(
        default=2, ge=0, le=64, description="Tool calls allowed before the answer."
    )
    max_segments: int = Field(default=4, ge=1, le=64, description="Compactions allowed plus one.")
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature.")
    tool_output_chars: int = Field(
        default=120, ge=8, le=100_000, description="Observation cap (chars)."
    )
    summary_chars: int = Field(
        default=60, ge=8, le=10_000, description="Summary cap when compacting."
    )
    summary: Literal["fixed", "policy"] = Field(
        default="fixed",
        description="Who writes the summary when the context is full: 'fixed' (a digest of the "
        "tool runs) or 'policy' (the model writes it, a turn it is trained on).",
    )
    summary_tokens: int = Field(
        default=32, ge=1, le=4096, description="Token budget of a summary the policy writes."
    )
    inference_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Weights precision for rollout inference (learner stays fp32).",
    )
    tool_sandbox: sandbox.SandboxConfig = Field(
        default_factory=lambda: sandbox.SandboxConfig(wall_timeout_s=3.0, cpu_limit_s=1),
        description="Limits (and the weakest isolation accepted) for tool calls.",
    )


def task_policy() -> PolicyConfig:
    """The default policy shape of every role: the built-in task family's vocabulary."""
    return PolicyConfig(vocab_size=protocol.VOCAB_SIZE)


def rollout_harness() -> HarnessConfig:
    """The default harness of rollout workers and of the eval role (48 tokens a turn)."""
    return HarnessConfig(max_new_tokens=48)


VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention runs (others start, then fail on the first request)."""


def check_vllm_policy(policy: PolicyConfig) -> None:
    """``ValueError`` for a policy shape vLLM's CPU attention cannot run (checked when a worker
    starts its engine: the run's policy is injected into the rollout config after validation)."""
    head = policy.head_size()
    if head is not None and head not in VLLM_HEAD_SIZES:
        raise ValueError(
            f"rollout.engine=vllm: vLLM's CPU attention cannot run heads of {head} (it runs "
            f"{', '.join(map(str, VLLM_HEAD_SIZES))}): set policy.head_dim, e.g. 64"
        )


class VllmConfig(BaseModel):
    """The ``vllm`` engine (``rollout.vllm_engine``): a vLLM OpenAI server the rollout worker starts
    from vLLM's own virtualenv (``make vllm``) and supervises, or one it is pointed at."""

    model_config = ConfigDict(extra="forbid")

    python: str | None = Field(
        None,
        description="Python of vLLM's virtualenv (default: $RLSTREAM_VLLM_PYTHON, else "
        ".venv-vllm/bin/python of the repository, which `make vllm` creates).",
        json_schema_extra=LOCAL,
    )
    url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Base URL of a vLLM server already running with rlstream's weight-transfer "
        "backend (docs/engines.md); the worker then starts none, and cannot restart it.",
        json_schema_extra=LOCAL,
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Precision the engine computes in (weights are sent as published)."
    )
    kv_cache_gib: float = Field(1.0, gt=0, le=4096, description="KV cache size of the engine.")
    max_num_seqs: int = Field(
        64, ge=1, le=4096, description="Sequences the engine runs in one batch at most."
    )
    threads: int = Field(1, ge=1, le=256, description="CPU threads of the engine's worker.")
    start_timeout_s: float = Field(
        600.0, gt=0, le=3600, description="Longest wait for a started server to answer /health."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, le=3600, description="Longest wait for one answer of the engine."
    )
    max_restarts: int = Field(
        5, ge=0, le=1000, description="Engine restarts a worker makes before it gives up."
    )
    check_every: int = Field(
        1,
        ge=0,
        le=1_000_000,
        description="Check the engine after every Nth version it takes (0: never): its logprobs "
        "of a fixed canary must match this worker's model on the same weights within "
        "`check_tolerance`; a version that does not is reloaded whole from disk, and the "
        "worker gives up when even that does not match (docs/engines.md).",
    )
    check_tolerance: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Largest canary logprob gap a checked engine may show (default: 1e-3 for a "
        "float32 engine, 0.1 for bfloat16, whose rounding alone moves logprobs that much).",
    )
    work_dir: str | None = Field(
        None,
        description="Where the model directory a server starts from is written (default: a new "
        "temporary folder); versions after the first travel through `shm_dir`.",
        json_schema_extra=LOCAL,
    )
    shm_dir: str = Field(
        "/dev/shm",
        description="Folder (in memory) of the files that carry a version's changed tensors.",
        json_schema_extra=LOCAL,
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More command-line arguments for the server."
    )
    backend: str = Field(
        "rlstream",
        pattern=r"^[A-Za-z_][\w.-]*$",
        description="vLLM weight-transfer backend the server loads versions through "
        "(`--weight-transfer-config`): rlstream's (package `rollout/vllm_server`, installed into "
        "vLLM's virtualenv by `make vllm`) or one registered under another name by a plugin or by "
        "`extension` (docs/engines.md).",
    )
    extension: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$",
        description="A worker extension class (`MODULE.CLASS`, found on `extension_path`) vLLM "
        "imports in its worker before the model loads, e.g. to register a backend of your own; "
        "none by default.",
    )
    extension_path: list[str] = Field(
        default_factory=list,
        description="Folders put on the server's PYTHONPATH (for `extension`).",
        json_schema_extra=LOCAL,
    )

    @property
    def tolerance(self) -> float:
        """The canary gap a checked engine may show (``check_tolerance`` or its dtype's)."""
        if self.check_tolerance is not None:
            return self.check_tolerance
        return 1e-3 if self.dtype == "float32" else 0.1


class RolloutConfig(BaseModel):
    """Config of a rollout worker."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("policy", description="Model name (weights.manifests key).")
    policy: PolicyConfig = Field(
        default_factory=task_policy,
        description="Policy shape; must match the learner's.",
    )
    harness: HarnessConfig = Field(
        default_factory=rollout_harness,
        description="How samples are rolled out.",
    )
    region: str = Field(
        "trainer",
        description="Region this worker runs in (recorded per sample); set from `--region`.",
    )
    seed: int = Field(0, ge=0, description="Sampling seed; each task's generator derives from it.")
    torch_threads: int = Field(
        1, ge=1, le=64, description="torch intra-op threads.", json_schema_extra=LOCAL
    )
    max_staleness: int = Field(
        2, ge=0, description="Staleness budget (injected from the run config): see the module."
    )
    weights_wait_s: float = Field(
        120.0, ge=0, le=3600, description="Longest wait for weights a task needs."
    )
    env_overlap: bool = Field(
        False,
        description="Generate on while groups wait out their environment's time after "
        "generation (`envs.tools.Environment.settle`), "
        "as sandboxes on machines of their own would: each group is published when its own "
        "time ends, its task committed with it (a restart regenerates a group still waiting).",
    )
    engine: Literal["torch", "openai", "vllm"] = Field(
        "torch",
        description="Inference engine: `torch` in process (reference); `openai`: the "
        "OpenAI-compatible server at `engine_url`, weights pushed to it (rollout.engines); "
        "`vllm`: a vLLM server the worker supervises, weights loaded in place (`[rollout.vllm]`).",
    )
    vllm: VllmConfig = Field(
        default_factory=VllmConfig, description="The `vllm` engine's server (rollout.vllm_engine)."
    )
    engine_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Base URL of the `openai` engine's server, e.g. http://127.0.0.1:8000.",
        json_schema_extra=LOCAL,
    )
    engine_weights_dir: str | None = Field(
        None,
        description="Folder versions are written to for the `openai` engine's server, which "
        "must read it at the same path (default: a new temporary folder).",
        json_schema_extra=LOCAL,
    )
    engine_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Longest wait for one answer of the `openai` engine."
    )
    swap: Literal["partial", "between_tasks"] = Field(
        "partial",
        description="When a verified version reaches the engine: `partial` as soon as it is "
        "verified, during a rollout (the trajectory records which tokens each version made; "
        "the `torch` and `vllm` engines); `between_tasks`: only between two tasks, so a group is "
        "generated by one version (the `openai` engine always swaps between tasks).",
    )
    lent: bool = Field(
        False,
        description="Tidal capacity: this worker's engine belongs to the region's serving fleet "
        "and rolls out only while the region's capacity role lends it (member N is capacity "
        "slot N: it rolls out while more than N engines are lent). A reclaim stops the group "
        "in progress and hands it on as a checkpoint. False: dedicated, always rolling out.",
        json_schema_extra=LOCAL,
    )
    capacity_stale_s: float = Field(
        10.0,
        gt=0,
        description="A lent worker whose region's capacity signal is older than this stops "
        "rolling out (a dead capacity role or a cut link reclaims everything).",
    )
    engine_stats_dir: str | None = Field(
        None,
        description="Folder the worker keeps its engine's figures in (REGION-MEMBER.json: "
        "engine, version, swaps, restarts, swap times), rewritten after every task.",
        json_schema_extra=LOCAL,
    )

    @model_validator(mode="after")
    def _engine_url(self) -> RolloutConfig:
        if self.engine == "openai" and self.engine_url is None:
            raise ValueError("rollout.engine=openai needs rollout.engine_url")
        return self


class EvalConfig(BaseModel):
    """Config of the eval role (``[eval]`` in a recipe)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("policy", description="Model name (weights.manifests key); injected.")
    policy: PolicyConfig = Field(
        default_factory=task_policy,
        description="Policy shape; injected from the run.",
    )
    families: dict[str, FamilySpec] = Field(
        default_factory=lambda: {"fx": FamilySpec()},
        description="Task families whose held-out tasks are scored; injected from the run.",
    )
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig, description="fx difficulty; injected."
    )
    harness: HarnessConfig = Field(
        default_factory=rollout_harness,
        description="How answers are generated: the rollout workers' harness (injected).",
    )
    isolation: sandbox.Mode = Field(
        "full", description="Weakest sandbox isolation accepted for scoring; injected."
    )
    seed: int = Field(0, ge=0, description="Sampling seed of the temperature-1 samples.")
    every: int = Field(
        10, ge=1, le=1_000_000, description="Evaluate version 0 and every N-th version after it."
    )
    eval_tasks: int = Field(
        32, ge=1, le=100_000, description="Held-out tasks per evaluation (split by family weight)."
    )
    k: int = Field(4, ge=1, le=256, description="Samples per task at temperature 1 (pass@k).")
    release_margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Release a version when its held-out greedy success is at least the last "
        "released version's minus this margin.",
    )
    max_version: int | None = Field(
        None, ge=0, description="Stop after evaluating this version (None: run until stopped)."
    )
    score_jobs: int = Field(2, ge=1, le=64, description="Sandboxed scoring runs at once.")
    torch_threads: int = Field(
        1, ge=1, le=64, description="torch intra-op threads.", json_schema_extra=LOCAL
    )
