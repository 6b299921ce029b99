"""The typed schema of one rlrun run.

Every section is a pydantic model with ``extra="forbid"`` so a misspelt key fails at load time.
Each field has a default that works for the CPU quickstart; docstrings say what the field means.
Derived values are properties; the config is never mutated after loading.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str = ".cache/models/SmolLM2-135M-Instruct"
    """Hugging Face model directory (config.json + safetensors + tokenizer files)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer. float32 on CPU; bfloat16 on GPU."""


class ParallelConfig(Section):
    tp: int = Field(1, ge=1)
    """Megatron tensor-parallel size. Must divide the number of attention heads and KV heads."""
    pp: int = Field(1, ge=1)
    """Megatron pipeline-parallel size."""

    @model_validator(mode="after")
    def _pp_supported(self) -> ParallelConfig:
        if self.pp != 1:
            raise ValueError("parallel.pp must be 1: pipeline-parallel training is not supported yet; use tp and data parallelism")
        return self


class DataConfig(Section):
    path: str = "configs/data/addition_train.jsonl"
    """Prompt file: ``.jsonl`` (one JSON object per line) or ``.parquet`` (one row per prompt),
    optionally sliced as ``path@[start:end]`` (Python slice of the rows, e.g. ``@[:1000]``, ``@[-50:]``)."""
    prompt_key: str = "prompt"
    """Key of the prompt text (or a list of chat messages) in each row."""
    label_key: str | None = "label"
    """Key of the reference answer passed to the reward function; None when rows have no label."""
    metadata_key: str | None = None
    """Key of a per-row object handed to rewards and generate hooks as ``prompt.metadata``; None makes
    every other key of the row the metadata."""
    tools_key: str | None = None
    """Key of the row's tool schemas (a list of objects, or a JSON string of one), passed to the chat
    template as ``tools=`` and to generate hooks as ``prompt.tools``; None: no tools."""
    apply_chat_template: bool = True
    """Wrap the prompt as a user turn and apply the tokenizer's chat template; false tokenizes the
    prompt text as is (rows must then hold strings)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``apply_chat_template``, e.g. ``{enable_thinking: false}``."""
    system_prompt: str | None = None
    """System turn to prepend when applying the chat template. None adds no system turn
    (and suppresses templates that would insert a default one)."""
    shuffle: bool = True
    """Shuffle prompts each epoch with a seed derived from ``seed`` and the epoch number."""


class RolloutConfig(Section):
    prompts_per_step: int = Field(4, ge=1)
    """Prompts drawn per step; each becomes a group of ``samples_per_prompt`` responses."""
    samples_per_prompt: int = Field(8, ge=1)
    """Group size n (GRPO needs >= 2 for a non-zero advantage)."""
    max_new_tokens: int = Field(8, ge=1)
    """Maximum response length in tokens."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value for log-probs."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 (or 0) keeps the whole vocabulary."""
    reward: str = "first_number"
    """Reward function: a built-in name (first_number, exact_match) or ``module:function`` /
    ``path/to/file.py:function`` with signature ``fn(sample: Sample) -> float`` (the sample carries
    the response text, finish_reason and the prompt's label). Resolved when the config is loaded."""


class EngineConfig(Section):
    backend: Literal["embedded", "sglang"] = "embedded"
    """Rollout engine. ``embedded`` is pure PyTorch and runs everywhere; ``sglang`` needs a GPU."""
    tp: int = Field(1, ge=1)
    """Engine tensor-parallel size (ranks per engine group)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for a worker to load its model and answer ``health``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """How long one RPC (a whole generate batch included) may take before the worker is declared hung."""
    bucket_bytes: int = Field(512 * 1024**2, ge=1024)
    """Size of one flattened weight-sync bucket."""

    @model_validator(mode="after")
    def _tp_supported(self) -> EngineConfig:
        if self.tp != 1:
            raise ValueError("engine.tp must be 1: multi-rank engine groups are not supported yet")
        return self


class AlgorithmConfig(Section):
    advantage_estimator: Literal["grpo"] = "grpo"
    """How advantages are computed from rewards."""
    normalize_std: bool = True
    """GRPO: divide the group-centred reward by the group std (False gives Dr.GRPO)."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO lower clip range: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """PPO upper clip range; None uses ``eps_clip``."""
    skip_tied_groups: bool = True
    """Drop groups whose rewards are all equal before training (their advantage is zero)."""

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Adam learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""


class TrainConfig(Section):
    num_steps: int = Field(60, ge=1)
    """Number of rollout + train steps."""
    max_tokens_per_micro_batch: int = Field(2048, ge=16)
    """Token budget of one micro-batch (prompt + response, after padding) per DP rank."""
    seed: int = 1234
    """Seeds data order, sampling and initialisation."""


class CheckpointConfig(Section):
    save_interval: int = Field(0, ge=0)
    """Save the trainer state every N steps (and at the end); 0 disables saving."""
    dir: str | None = None
    """Where checkpoints go; None uses ``RUN_DIR/checkpoints``."""


class LoggingConfig(Section):
    run_dir: str = "runs/quickstart"
    """Directory for metrics.jsonl, the resolved config, engine sockets and worker logs."""
    console: bool = True
    """Print a one-line summary per step on rank 0."""


class OffloadConfig(Section):
    train: bool = False
    """Put the trainer to sleep (torch_memory_saver) while the engine generates. No-op on CPU."""
    rollout: bool = False
    """Release engine memory while the trainer trains. No-op on CPU."""


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    engine: EngineConfig = EngineConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    offload: OffloadConfig = OffloadConfig()
