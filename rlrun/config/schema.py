"""The typed schema of one rlrun run.

Every section is a pydantic model with ``extra="forbid"`` so a misspelt key fails at load time.
Each field has a default that works for the CPU quickstart, except the keys of ``REQUIRED_KEYS`` (the model,
the prompts and the reward), which every config sets; docstrings say what the field means.
Derived values are properties; the config is never mutated after loading.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


REQUIRED_KEYS: dict[str, str] = {
    "model.path": "set it to a Hugging Face directory or hub id",
    "data.path": "set it to a prompt file (.jsonl, .parquet) or a datasets directory",
    "rollout.reward": "set it to a built-in reward (math, gsm8k, exact_match, ...), an http(s):// reward server or "
    "module:function, or leave it unset with rollout.agent whose return is the reward (rollout.agent_scores)",
}
"""The keys with no default (no model, prompts or reward fits every run; the quickstart configs set them), each
with the fix its error names: ``<file>: <key> is required: <fix>``."""


def required_message(key: str) -> str:
    """The error of a missing ``REQUIRED_KEYS`` key, as the loader and the validators word it."""
    return f"{key} is required: {REQUIRED_KEYS[key]}"


LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
"""``model.moe.load_balancing``'s values (rlrun/megatron/moe.py)."""
Dispatcher = Literal["auto", "alltoall", "allgather"]
"""``model.moe.token_dispatcher``'s values (rlrun/megatron/moe.py)."""
ReleaseCache = Literal["when_needed", "always"]
"""``offload.release_cache``'s values."""
OptimizerCopy = Literal["overlapped", "with_weights"]
"""``offload.optimizer_copy``'s values."""


class MoEConfig(Section):
    """Routing and load balancing of mixture-of-experts models (Megatron's ``moe_*`` options; ignored for
    dense models). The fields are ``rlrun.megatron.moe.MoEOptions``'s."""

    load_balancing: LoadBalancing = "aux_loss"
    """Megatron's ``moe_router_load_balancing_type``: the auxiliary loss over each micro-batch's tokens
    (``aux_loss``), per sequence (``seq_aux_loss``), over the global batch (``global_aux_loss``), or none."""
    aux_loss_coeff: float | None = Field(None, ge=0)
    """Weight of the load-balancing loss; None: the checkpoint's ``router_aux_loss_coef``."""
    z_loss_coeff: float | None = Field(None, ge=0)
    """Weight of the router z-loss (mean squared logsumexp of the router logits); None: off."""
    token_dispatcher: Dispatcher = "auto"
    """How tokens reach their experts' EP ranks. ``auto``: ``alltoall`` on CUDA, ``allgather`` on CPU
    (Megatron's all-to-all dispatcher needs CUDA streams)."""


PackedAttention = Literal[
    "auto", "per_sample", "efficient_varlen", "chunked_varlen", "flash_varlen", "cudnn_per_sample"
]
"""``model.packed_attention``'s values (rlrun/megatron/attention.py)."""
BF16_KERNEL_ATTENTION = ("chunked_varlen", "flash_varlen", "cudnn_per_sample")
"""The ``model.packed_attention`` values with a kernel of their own (CUDA, bf16), instead of the shared
memory-efficient kernel that context parallelism and multi-latent attention run."""
LMHead = Literal["chunked", "chunked_kept", "logits"]
"""``model.lm_head``'s values (rlrun/megatron/lm_head.py)."""
RecomputeMode = Literal["none", "selective", "full"]
"""``train.recompute``'s values (rlrun/megatron/recompute.py)."""


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""``model.lora.target_modules``' values: the HF projections (PEFT's names; rlrun/megatron/lora.py)."""


class LoraConfig(Section):
    """LoRA (arXiv 2106.09685) on the actor's attention and MLP linears (rlrun/megatron/lora.py): the base weights
    are frozen (no gradients, no optimizer state), the engine gets merged weights, the KL reference is the base
    (adapters off), and every checkpoint holds the adapters in PEFT's format (``step_N/adapter``). Dense
    models only (no MoE, no multi-latent attention), with ``parallel.tp`` dividing the KV heads."""

    rank: int = Field(16, ge=1)
    """The adapters' rank r: ``A`` is ``[r, in]``, ``B`` ``[out, r]``."""
    alpha: float = Field(32.0, gt=0)
    """The branch is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the branch input (PEFT's ``lora_dropout``), in training forwards only: the old-policy and
    reference forwards stay the model the engine samples. Above 0 the training forward no longer reproduces
    the old log-probs exactly (``algorithm.max_logprob_gap``'s step-0 check)."""
    target_modules: tuple[LoraTarget, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """The HF projections that get adapters; the rest of the model stays frozen as is."""

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(
                f"model.lora.target_modules ({list(self.target_modules)}) must list distinct projections, at "
                "least one, because each gets one adapter; e.g. [q_proj, v_proj]"
            )
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ModelConfig(Section):
    path: str
    """Hugging Face model directory (config.json + safetensors + tokenizer files) or hub id (docs/models.md).
    Required: no model fits every run (the quickstart configs name .cache/models/SmolLM2-135M-Instruct)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer. float32 on CPU; bfloat16 on GPU."""
    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts options (Qwen3-MoE, Qwen2-MoE)."""
    packed_attention: PackedAttention = "auto"
    """How the trainer attends packed rows (several samples in one row) without TransformerEngine:
    ``per_sample``, one attention call per sample (everywhere; slow: host-bound at RL batch sizes);
    ``chunked_varlen``, rlrun's chunked Triton kernels (CUDA, bfloat16; rlrun/kernels/chunked_attention.py), which the
    embedded engine then runs too, its decode split over thread blocks and still bitwise the trainer's forward, so
    trainer and engine log-probs agree (docs/on_policy.md; SGLang does not run them: off-policy with engine.backend
    sglang, as every kernel is); ``efficient_varlen``, one memory-efficient varlen call per layer for the whole row
    (CUDA, any dtype), which the embedded engine then runs too (exact as well; its decode one thread block a row and
    head); ``flash_varlen``, one FlashAttention-2 varlen call per layer (CUDA, bfloat16; off-policy in bf16 because no
    engine runs that kernel: BENCHMARKS.md, "Exactness"); ``cudnn_per_sample``, cuDNN's fused attention, one call per
    sample (CUDA, bfloat16; the fastest for long samples, the slowest for short ones: BENCHMARKS.md, "The attention
    kernel at long context"; off-policy like flash_varlen); ``auto``, chunked_varlen on CUDA in bfloat16 where Triton
    is, efficient_varlen elsewhere on CUDA (float32), else per_sample (rlrun.kernels.attention.auto_packed_attention).
    Unpacked rows (one sample per row) run the same kernel as packed ones."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of the whole actor (``LoraConfig``); None: full fine-tuning."""
    lm_head: LMHead = "chunked"
    """How the trainer applies the LM head (rlrun/megatron/lm_head.py): ``chunked`` projects the final hidden
    states to logits one token chunk at a time, in the forward and again in the backward, so no
    ``[tokens, vocab]`` logits tensor exists (9.3 GB of bf16 at 32K tokens of Qwen3's vocabulary; the same
    numbers, ~1/3 more LM-head FLOPs); ``chunked_kept`` is ``chunked`` with each chunk's logits kept from the
    forward for the backward (no second projection, so none of ``chunked``'s extra LM-head FLOPs, for ``[tokens,
    vocab]`` of the model's dtype held per micro-batch in flight, half of what ``logits`` holds); ``logits`` keeps
    Megatron's output layer and its logits (for comparison). With a chunked head the train step projects only
    the loss mask's positions. Top-p mask replay (``rollout.top_p`` < 1, embedded engine) materialises the logits
    either way."""


class ParallelConfig(Section):
    tp: int = Field(1, ge=1)
    """Megatron tensor-parallel size. When it does not divide the KV heads, inert zero head groups are
    padded in (stripped on export; the extra compute is logged at start)."""
    pp: int = Field(1, ge=1)
    """Megatron pipeline-parallel size (1F1B schedule). It must divide the model's layers, and ``tp * pp``
    the number of processes (checked when the model is built and at start-up)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size of MoE models: each EP rank holds ``num_experts / ep`` experts. It must divide
    the experts, and ``ep * etp`` the processes of one pipeline stage (EP ranks are data-parallel ranks
    for the dense layers). MoE models need ``tp == 1`` (see rlrun/megatron/moe.py)."""
    etp: int = Field(1, ge=1)
    """Expert tensor-parallel size: each expert's weights split over ``etp`` ranks."""
    cp: int = Field(1, ge=1)
    """Context-parallel size of the trainer (rlrun/megatron/context_parallel.py): ``cp`` ranks share every
    sequence, each holding two of its ``2 cp`` chunks and all-gathering the keys and values, so activation
    memory per rank falls by ``cp``; ``tp * pp * cp`` must divide the processes (the CP ranks of a group train
    the same samples). Each micro-batch then holds one sample (no packing). Dense models without a critic at
    PP 1 only; tested on CPU (CP 2 equals CP 1), not yet on GPUs."""

    @model_validator(mode="after")
    def _context_parallel_scope(self) -> ParallelConfig:
        if self.cp > 1 and (self.pp > 1 or self.ep > 1 or self.etp > 1):
            raise ValueError(
                f"parallel.cp ({self.cp}) must go with pp, ep and etp 1 (not {self.pp}, {self.ep}, {self.etp}) "
                "because context parallelism is implemented and tested for dense models without pipelining; set "
                "parallel.cp: 1 or the others to 1"
            )
        return self

    def __str__(self) -> str:
        """``tp=2 pp=1``, plus ``ep`` / ``etp`` when they split experts: dense layouts read as they always did."""
        return " ".join(f"{name}={value}" for name, value in self if name in ("tp", "pp") or value != 1)


class DataConfig(Section):
    path: str
    """Required. Prompt file: ``.jsonl`` (one JSON object per line) or ``.parquet`` (one row per prompt;
    verl's layout reads as is), or through the optional ``datasets`` package a directory (``save_to_disk``'s,
    or data files ``load_dataset`` reads) or a ``.csv`` / ``.arrow`` file; optionally sliced as
    ``path@[start:end]`` (Python slice of the rows, e.g. ``@[:1000]``, ``@[-50:]``). Every ``*_key`` below may be dotted
    (``reward_model.ground_truth``) to reach into nested objects (docs/bring-your-own.md)."""
    split: str = "train"
    """Split read from a ``datasets`` source that has several (a saved ``DatasetDict``, ``load_dataset``'s)."""
    prompt_key: str = "prompt"
    """Key of the prompt text (or a list of chat messages) in each row."""
    label_key: str | None = "label"
    """Key of the reference answer passed to the reward function; None when rows have no label. A built-in
    reward compares text, so a key holding an object is refused at load naming the dotted key to use."""
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
    sampler: str | None = None
    """A prompt source of your own (slime's ``--data-source-path``): ``module:function`` /
    ``path/to/file.py:function`` with signature ``fn(dataset: PromptDataset, seed: int, shuffle: bool) ->
    PromptSource`` (``next_batch(n)``, JSON ``state_dict()``, ``load_state_dict(state)``, ``dataset``;
    rlrun/data/source.py, example examples/hooks/sources.py). None: the seeded, shuffled-per-epoch sampler."""
    source_key: str = "source"
    """Metadata key naming a row's data source (one dataset of a mixture): the step's rewards are also logged
    per source (``rollout/source/<source>/reward``, eval likewise); rows without the key are not broken down."""


class RemoteRewardConfig(Section):
    timeout_s: float = Field(30.0, gt=0)
    """Per-attempt limit on one reward request (connect + reply)."""
    max_retries: int = Field(3, ge=0)
    """Extra attempts after a connection error, a timeout, or HTTP 429 / 5xx (other HTTP errors fail at once)."""
    retry_backoff_s: float = Field(0.5, ge=0)
    """Wait before retry k (0-based) is ``retry_backoff_s * 2**k``."""
    max_concurrency: int = Field(16, ge=1)
    """Requests in flight at once per rank (the server sees up to this times the number of ranks)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """HTTP headers sent with every request, e.g. ``{Authorization: "Bearer ${REWARD_TOKEN}"}``: ``$VAR`` and
    ``${VAR}`` are replaced by environment variables when the reward is loaded (a variable that is not set
    fails then, naming it). The expanded values go only into the requests (never logged); keep secrets in
    the environment and name them here, so the YAML and ``config show`` hold only the reference."""


class RolloutConfig(Section):
    prompts_per_step: int = Field(4, ge=1)
    """Prompts drawn per step; each becomes a group of ``samples_per_prompt`` responses."""
    samples_per_prompt: int = Field(8, ge=1)
    """Group size n (GRPO needs >= 2 for a non-zero advantage)."""
    max_new_tokens: int = Field(8, ge=1)
    """Maximum response length in tokens."""
    ignore_eos: bool = False
    """Keep generating past EOS and stop tokens up to ``max_new_tokens`` (fixed-length responses, for
    benchmarks that must compare equal work)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value for log-probs."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 with the embedded engine, each draw's kept set is replayed in the trainer
    (top-p mask replay, docs/on_policy.md): both sides' log-probs are renormalised over it, so the ratio is
    for the policy that sampled; a filtering row keeps at most 512 tokens (``sampling.KEPT_SET_WIDTH``).
    SGLang returns no kept sets: there both sides stay on the unfiltered distribution."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 (or 0) keeps the whole vocabulary (with top_p < 1: at most 512 tokens, above)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (SGLang's ``stop``): a response ends with the token that completes one of them in its
    decoded text; that token stays in the response (``finish_reason`` "stop"). Not affected by
    ``ignore_eos``. A ``generate_fn`` may pass its own per turn (``traj.generate(stop=...)``)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a response (kept in it), on top of the model's EOS; ``ignore_eos`` disables them."""
    skip_special_tokens: bool = True
    """Drop special tokens when decoding a single-turn response (and the text ``traj.generate()`` returns)
    into the text rewards read. The engine returns token ids only, so this is the trainer's decode; the
    trained tokens are the same either way. A multi-turn sample's ``response_text`` always keeps them, so
    its turns stay visible."""
    reward: str | None = None
    """Reward function: a built-in name (math, gsm8k, exact_match, format_boxed, format_think,
    first_number; slime's dapo, deepscaler, f1: rlrun/rollout/rewards/builtin.py), an ``http(s)://`` URL
    of a reward server (see ``remote_reward``), or ``module:function`` / ``path/to/file.py:function``
    with signature ``fn(sample: Sample) -> float`` (plain or ``async def``; the sample carries the
    response text, finish_reason and the prompt's label and metadata). Resolved when the config is
    loaded. A reward that raises scores 0 and is counted in ``rollout/reward_errors`` and logged with
    its message. Required, unless ``agent`` is set with ``agent_scores`` (the agent's return is then the
    reward and this is never called): None only there."""
    rewards: dict[str, str] = Field(default_factory=dict)
    """Multi-task data: named reward functions (each a spec as ``reward`` takes) that a row selects by its
    metadata's ``reward_type_key`` value (slime's per-sample ``rm_type``); rows without that key use
    ``reward``. A row naming a type missing here fails when the data is loaded."""
    reward_type_key: str = "reward_type"
    """Metadata key of a row's reward type (a name in ``rewards``); only read when ``rewards`` is set."""
    reward_key: str | None = None
    """A reward function may return a dict of named scores (``{"correct": 1.0, "format": 0.5}``): the value
    under this key is the reward that trains, and every key's mean is logged (``rollout/reward/<key>``).
    None: a dict reward fails its sample (reward 0, counted in ``rollout/reward_errors``)."""
    reward_post_process: str | None = None
    """Reshape the step's rewards once its batch is known (slime's ``--custom-reward-post-process-path``):
    ``module:function`` / ``path/to/file.py:function`` with signature ``fn(samples: list[Sample]) ->
    list[float]``, called on rank 0 with the trained samples (whole groups, prompt-major) before advantages;
    its values replace the rewards (rlrun/rollout/rewards/post_process.py, example examples/hooks/rewards.py)."""
    reward_per_group: bool = False
    """Call a custom reward once per group as ``fn(samples: list[Sample]) -> list[float]`` (e.g. to
    rank a prompt's responses against each other) instead of once per sample."""
    reward_concurrency: int = Field(64, ge=1)
    """How many async reward calls (samples or groups) a rank awaits at once."""
    reward_timeout_s: float | None = Field(None, gt=0)
    """Longest one reward call (a sample, or a group with ``reward_per_group``) may take, in seconds. Set, each
    call runs in one of the rank's reward processes (rlrun/rollout/rewards/processes.py); a call past the limit
    has its process killed, scores 0 and is counted in ``rollout/reward_errors``, and the run goes on (a hung
    verifier or sandbox costs one sample, not the job). The function, its sample and its result must pickle
    (module or file functions do; a closure does not). ``http(s)://`` rewards stay in the rank, cancelled at
    the limit, with their own per-request ``remote_reward.timeout_s``. None: calls run in the rank, unlimited."""
    reward_processes: int = Field(4, ge=1)
    """Reward processes per rank (calls in flight at once) when ``reward_timeout_s`` is set; started on first
    use and kept for the run."""
    remote_reward: RemoteRewardConfig = RemoteRewardConfig()
    """Timeouts, retries and concurrency for an ``http(s)://`` reward."""
    generate_fn: str | None = None
    """Custom multi-turn / tool-use generation: ``module:function`` or ``path/to/file.py:function``,
    an ``async def fn(traj: Trajectory) -> None | list[Sample]`` that drives the engine turn by turn
    (rlrun/rollout/multiturn.py; example: examples/calculator_tool). Returning a list makes the trajectory
    several training samples sharing its reward and group score (example: examples/hooks/judge_agent.py).
    None: one engine call per prompt."""
    agent: str | None = None
    """Agent code as users write it (rlrun/agents/runner.py, docs/agents.md, example examples/openai_agent):
    ``module:function`` / ``path/to/file.py:function``, an ``async def agent(client, row) -> float | dict |
    None`` run once per response, with ``client`` an ``openai.AsyncOpenAI`` on this rank's OpenAI-compatible
    endpoint (127.0.0.1, its own session, a per-rollout key) and ``row`` the dataset row as a dict. Its
    requests are recorded token in, token out and trained on the engine's tokens and log-probs; sampling
    follows ``temperature`` / ``top_p`` / ``top_k`` here whatever a request asks. None: no agent."""
    agent_concurrency: int = Field(64, ge=1)
    """Agents a rank runs at once (and engine requests it keeps in flight for them)."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """Longest one agent run may take; past it the agent is cancelled, scores 0 and is counted in
    ``rollout/reward_errors``, and the step goes on."""
    agent_scores: bool = True
    """The agent's return value is the reward (a number, or a dict of named scores with ``reward_key``);
    false: the agent returns nothing and ``reward`` scores its sample (the last turn's text and the tokens)."""
    agent_tool_parser: Literal["hermes"] = "hermes"
    """How tool calls are read from the model's text into OpenAI ``tool_calls`` when a request gives ``tools``:
    ``hermes`` is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""
    rollout_fn: str | None = None
    """Replaces each sampling round's generation on every rank (slime's ``--rollout-function-path``):
    ``module:function`` / ``path/to/file.py:function`` with signature
    ``fn(ctx: RolloutContext) -> list[list[Sample]]``, given the round's prompts of the rank, the step, the
    seed, the engine client and rlrun's generation (``ctx.generate``), returning one group per prompt; the
    groups are then scored, filtered and trained as rlrun's own (rlrun/rollout/rollout_fn.py, example
    examples/hooks/rollout_fn.py). Evaluation generates as usual. None: rlrun generates."""
    rollout_fn_scores: bool = False
    """The ``rollout_fn`` sets ``sample.reward`` itself (as slime's rollout functions do), so ``reward`` is
    not called on its samples; false: they are scored with ``reward`` like any others."""
    sample_to_train: str | None = None
    """What each rollout sample trains as (slime's ``--custom-convert-samples-to-train-data-path``):
    ``module:function`` / ``path/to/file.py:function`` with signature ``fn(sample: Sample) -> list[Sample]``,
    called on rank 0 after the group scores; every returned sample (none drops it) trains with its
    sample's group score (rlrun/rollout/train_samples.py, example examples/hooks/train_samples.py).
    None: a sample trains as itself, or as its ``parts`` when a ``generate_fn`` returned several."""
    max_context_tokens: int | None = Field(None, ge=2)
    """Prompt + response limit of one multi-turn trajectory (``generate_fn``): turns get at most the
    room left and a full trajectory ends with finish_reason "length". None uses the model's
    ``max_position_embeddings``."""
    dynamic_filter: str | None = None
    """Drop whole groups before training and draw more prompts until ``prompts_per_step`` groups pass:
    ``nonzero_std`` (DAPO: drop groups whose rewards are all equal) or ``module:function`` /
    ``path/to/file.py:function`` with signature ``fn(group: list[Sample]) -> bool`` (True keeps).
    None keeps every group."""
    over_sampling_prompts: int | None = Field(None, ge=1)
    """Prompts drawn per sampling round (>= prompts_per_step), so a filter has spares; groups beyond
    ``prompts_per_step`` that pass are discarded. None draws ``prompts_per_step``."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Most rounds of draw -> generate -> filter per step. When the limit is hit with fewer groups
    than ``prompts_per_step``, the step trains on those (or, if none passed, on the last round's
    groups unfiltered) and ``rollout/filter_exhausted`` is 1."""

    abort_surplus: bool = False
    """Stream each round (one engine call per group, rlrun/rollout/streaming.py) and abort the groups still
    generating as soon as ``prompts_per_step`` groups are kept, instead of generating every drawn group to
    its end and discarding the surplus. Which groups make the batch then depends on timing (the first to
    finish and pass the filter), as in slime. Single-turn generation with ``engine.tp`` 1 only."""
    partial_rollout: bool = False
    """slime's ``--partial-rollout`` (implies ``abort_surplus``): the groups aborted at the batch boundary,
    and finished groups beyond the batch, are carried into the next step instead of discarded; a carried
    sample continues from prompt + its tokens so far under the then-current weights (its tokens per
    weight version in ``Sample.weight_spans``), so the step never waits for the longest response. Every
    drawn group is trained exactly once (or dropped by the filter). The carry is checkpointed
    (``rollout_carry.pt``); a run without partial rollout refuses to resume a checkpoint that carries groups."""
    partial_rollout_mask_offpolicy: bool = False
    """slime's ``--mask-offpolicy-in-partial-rollout``: a carried sample's tokens generated by older
    weights get loss mask 0 (context only); without it they train, corrected like any rollout/trainer
    mismatch (``algorithm.tis``)."""
    max_staleness: int = Field(0, ge=0)
    """Bounded-staleness asynchronous RL (docs/async.md): the engine generates up to K steps ahead on a
    background thread while the trainer trains, so step n's samples come from weights at most K updates older
    than the ones that train on them (``rollout/versions_behind_*``). 0: the synchronous loop. 1 overlaps each
    rollout with the previous step's training; 2 also absorbs a slow rollout behind two training steps. The
    importance ratios then see the sampling policy's age: correct it with ``algorithm.tis``. Needs
    ``engine.tp`` 1, ``engine.sync_interval`` 1, no offload, no ``algorithm.max_logprob_gap`` and no partial
    rollout (checked at load)."""
    continue_after_tokens: int | None = Field(None, ge=1)
    """With ``max_staleness`` K >= 2 (docs/async.md): step m's rollout samples every response's first N tokens
    under the weights trained through step m-K-1, then continues the responses longer than N from their tokens
    under the weights trained through step m-K, the update the trainer publishes while the rollout runs
    (waiting for it if the trainer is not there yet). Responses of N tokens or fewer stay wholly K versions
    behind; the rest of a longer one is K-1 behind, each token's version kept in ``Sample.weight_spans`` and
    corrected token by token (``algorithm.tis``). A smaller N gives more tokens the fresher weights and leaves
    less of the rollout to overlap step m-K's training (the rollout can finish only after it); half of
    ``max_new_tokens`` gives them only to the long tail. The boundary is a token count, so runs repeat and resume
    exactly. Must be below ``max_new_tokens``. None: each rollout runs wholly under one version. Single-turn
    generation only (no ``generate_fn``, ``agent`` or ``rollout_fn``)."""

    @property
    def streams(self) -> bool:
        """Rounds stream groups and abort the rest once the batch is full."""
        return self.abort_surplus or self.partial_rollout

    @model_validator(mode="after")
    def _over_sampling_covers_a_batch(self) -> RolloutConfig:
        if self.reward is None and not (self.agent is not None and self.agent_scores):
            raise ValueError(required_message("rollout.reward"))
        if self.streams and self.generate_fn is not None:
            raise ValueError(
                f"rollout.generate_fn ('{self.generate_fn}') must be unset with rollout.abort_surplus / "
                "rollout.partial_rollout because a multi-turn trajectory cannot be aborted and continued from "
                "its tokens; unset one of them"
            )
        if self.agent is not None and (self.generate_fn is not None or self.streams):
            raise ValueError(
                f"rollout.agent ('{self.agent}') must be unset with rollout.generate_fn / rollout.abort_surplus / "
                "rollout.partial_rollout because an agent run is its own multi-turn generation, which cannot be "
                "aborted and continued from its tokens; unset one of them"
            )
        if self.streams and self.rollout_fn is not None:
            raise ValueError(
                f"rollout.rollout_fn ('{self.rollout_fn}') must be unset with rollout.abort_surplus / "
                "rollout.partial_rollout because the function generates a round's groups in one call, which "
                "cannot be aborted at the batch boundary nor carried into the next step; unset one of them"
            )
        if self.rollout_fn_scores and self.rollout_fn is None:
            raise ValueError(
                "rollout.rollout_fn_scores (true) must come with rollout.rollout_fn because it says that "
                "function sets the rewards; set rollout.rollout_fn or rollout.rollout_fn_scores: false"
            )
        if self.rollout_fn_scores and (self.reward_per_group or self.rewards):
            raise ValueError(
                f"rollout.rollout_fn_scores (true) must not come with rollout.reward_per_group "
                f"({self.reward_per_group}) / rollout.rewards ({sorted(self.rewards)}) because the rollout "
                "function's samples are not scored by them; unset those, or set rollout.rollout_fn_scores: false"
            )
        if self.partial_rollout_mask_offpolicy and not self.partial_rollout:
            raise ValueError(
                "rollout.partial_rollout_mask_offpolicy (true) must come with rollout.partial_rollout because "
                "only carried samples have tokens of older weights; set rollout.partial_rollout: true"
            )
        if any(not stop for stop in self.stop):
            raise ValueError(
                f"rollout.stop ({self.stop}) must hold non-empty strings because an empty stop string would "
                "match before the first token; drop the empty entry"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"rollout.stop_token_ids ({self.stop_token_ids}) must be >= 0 because they are vocabulary ids; "
                "fix the negative entry"
            )
        if self.over_sampling_prompts is not None and self.over_sampling_prompts < self.prompts_per_step:
            raise ValueError(
                f"rollout.over_sampling_prompts ({self.over_sampling_prompts}) must be >= "
                f"rollout.prompts_per_step ({self.prompts_per_step}) because each round draws at least "
                "one batch; raise it or set it to null"
            )
        return self

    @property
    def prompts_per_round(self) -> int:
        return self.over_sampling_prompts or self.prompts_per_step


class EvalDatasetConfig(Section):
    name: str
    """Metric prefix: ``eval/<name>/...``."""
    path: str
    """Prompt file (jsonl / parquet, ``@[start:end]`` slices allowed); read like ``data.path``."""
    prompt_key: str | None = None
    """Key of the prompt in this file; None uses ``data.prompt_key``."""
    label_key: str | None = None
    """Key of the label in this file; None uses ``data.label_key``."""
    samples_per_prompt: int | None = Field(None, ge=1)
    """Responses per prompt for this set (n of its pass@k); None uses ``eval.samples_per_prompt``."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature for this set; None uses ``eval.temperature``, then ``rollout.temperature``."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Response length limit for this set; None uses ``eval.max_new_tokens``, then ``rollout.max_new_tokens``."""
    stop: list[str] | None = None
    """Stop strings for this set; None uses ``rollout.stop``."""
    reward: str | None = None
    """Reward for every row of this set (a spec as ``rollout.reward`` takes); None scores as training does
    (``rollout.reward``, or the row's ``rollout.rewards`` type)."""
    reward_key: str | None = None
    """Key of a dict reward that scores this set; None uses ``rollout.reward_key``."""

    def data_config(self, base: DataConfig) -> DataConfig:
        """``base`` (template, system prompt, other keys) with this dataset's path and keys."""
        update = {"path": self.path, "shuffle": False}
        update.update({k: v for k, v in (("prompt_key", self.prompt_key), ("label_key", self.label_key)) if v})
        return base.model_copy(update=update)


class EvalConfig(Section):
    interval: int = Field(0, ge=0)
    """Evaluate before steps 0, N, 2N, ... (on the weights that step's rollout uses); 0 disables."""
    datasets: list[EvalDatasetConfig] = Field(default_factory=list)
    """Eval sets, each ``{name, path}``; scored with ``rollout.reward`` and ``rollout.generate_fn``."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses per eval prompt (n of pass@k)."""
    pass_k: list[int] = Field(default_factory=lambda: [1])
    """k values of pass@k to log; those above ``samples_per_prompt`` are skipped."""
    success_threshold: float = 1.0
    """A response counts as solved for pass@k when its reward is at least this."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature for eval; None uses ``rollout.temperature``."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Response length limit for eval; None uses ``rollout.max_new_tokens``."""
    before_train: bool = True
    """Evaluate before step 0 (the initial weights); false starts training at once and evaluates first
    before step ``interval`` (slime's ``--skip-eval-before-train``)."""

    @model_validator(mode="after")
    def _datasets_when_enabled(self) -> EvalConfig:
        if not self.before_train and self.interval == 0:
            raise ValueError(
                "eval.before_train (false) must be true when eval.interval is 0 because no eval runs at all; "
                "set eval.interval > 0 or drop eval.before_train"
            )
        if self.interval > 0 and not self.datasets:
            raise ValueError(
                f"eval.interval ({self.interval}) must be 0 when eval.datasets is empty because there "
                "is nothing to evaluate; add eval.datasets: [{name: ..., path: ...}] or set eval.interval: 0"
            )
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(
                f"eval.datasets names ({names}) must be unique because they prefix the metrics; rename one"
            )
        return self

    def rollout_for(self, rollout: RolloutConfig, ds: EvalDatasetConfig) -> RolloutConfig:
        """The rollout settings eval set ``ds`` generates and scores with: its own, else eval's, else the run's."""
        update: dict[str, Any] = {
            "samples_per_prompt": ds.samples_per_prompt or self.samples_per_prompt,
            "temperature": ds.temperature or self.temperature or rollout.temperature,
            "max_new_tokens": ds.max_new_tokens or self.max_new_tokens or rollout.max_new_tokens,
            "stop": rollout.stop if ds.stop is None else ds.stop,
            "reward_key": ds.reward_key or rollout.reward_key,
        }
        if ds.reward is not None:
            update.update(reward=ds.reward, rewards={})
        return rollout.model_copy(update=update)


class DebugConfig(Section):
    rollout_only: bool = False
    """Generate, score, evaluate and log rollout metrics, but never train or sync weights (the
    engine keeps its initial weights): for debugging data, rewards and generate hooks."""
    save_rollout_data: bool = False
    """Write each step's trained samples to ``RUN_DIR/debug/rollout_{step:06d}.jsonl``."""
    load_rollout_data: str | None = None
    """Directory of saved ``rollout_{step:06d}.jsonl`` files: train on them instead of generating."""
    save_train_data: bool = False
    """Write each rank's micro-batches (tokens, masks, log-probs, advantages) after the log-prob pass
    to ``RUN_DIR/debug/train_{step:06d}_rank{rank}.pt``."""

    @model_validator(mode="after")
    def _one_direction(self) -> DebugConfig:
        if self.rollout_only and self.load_rollout_data:
            raise ValueError(
                "debug.rollout_only (true) must be false when debug.load_rollout_data is set because one "
                "skips training and the other skips generation; unset one of them"
            )
        return self


class EngineConfig(Section):
    backend: str = "embedded"
    """Rollout engine (one of ``rlrun.engine.backends.BACKENDS``). ``embedded`` is pure PyTorch and runs
    everywhere; ``sglang`` needs a GPU."""
    tp: int = Field(1, ge=1)
    """Ranks per engine group (rlrun/engine/group.py): ``tp`` consecutive local ranks share one engine,
    which only the group's first rank (the leader) starts and drives; the others hand it their prompts.
    ``sglang`` runs with ``tp_size=tp`` over the group's GPUs; the ``embedded`` engine is not sharded:
    one engine on the leader's device serves the group. Must divide the ranks per node (checked at start)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for a worker to load its model and answer ``health``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """How long one RPC (a whole generate batch included) may take before the worker is declared hung."""
    heartbeat_timeout_s: float = Field(8.0, gt=0)
    """How long a worker may leave heartbeats unanswered (stopped, frozen, its event loop blocked)
    before the waiting call fails; a dead worker is reported at once regardless. Keep it under 10 s."""
    max_restarts: int = Field(0, ge=0)
    """How many times in one job a lost engine (its worker exited, stopped answering heartbeats or timed
    out) is restarted in place instead of ending the job (rlrun/trainer/recovery.py): the rank (an engine
    group: its leader, with its members) starts a fresh worker, re-syncs the current weights and redoes the
    step's rollout with the same prompts (lost mid-sync: re-syncs and goes on); the other ranks wait at a
    barrier bounded by ``startup_timeout_s``. Counted over all engines (``engine/restarts``); the loss past
    the limit ends the job with its cause. 0: any lost engine ends the job within seconds. With
    ``placement.engine_ranks`` an engine rank restarts its worker the same way, with the weights rank 0
    broadcasts again; the engine rank's own process is not restarted (its death ends the torchrun job). With
    ``rollout.max_staleness`` > 0 the loss surfaces on the rollout thread: the restarted engine loads the
    weights the lost rollout sampled with (kept for that; one more host copy of the weights) and that rollout
    and the ones launched after it are redone with the same prompts and seeds."""
    bucket_bytes: int = Field(512 * 1024**2, ge=1024)
    """Size of one flattened weight-sync bucket. Each bucket costs one transfer to the engine on top of its bytes, so
    larger buckets sync a large model faster (BENCHMARKS.md, "Weight sync with one copy on the trainer's side"), at the
    price of up to two buckets of extra device memory on the trainer while the sync runs."""
    sync_interval: int = Field(1, ge=1)
    """Push the trainer's weights to the engine after every N-th step (slime's ``--update-weights-interval``):
    the steps in between sample with weights up to N - 1 updates old. ``algorithm.keep_old_actor`` then keeps
    the weights the engine holds, so the importance ratio is taken against the policy that sampled; without
    it the old log-probs are the live weights' (correct the engine's staleness with ``algorithm.tis``).
    A resume syncs the restored weights at once, so ``checkpoint.save_interval`` must be a multiple of it (a
    checkpoint-and-stop between syncs resumes as if the engine had just been synced)."""
    verify_weights: bool = False
    """Debug: after every weight sync, check that the engine holds exactly the bytes sent (per-tensor
    sha256 on both sides, one extra pass over the weights). Backends with weight checksums only (embedded)."""
    server_args: dict[str, Any] = {}
    """Extra keyword arguments of the backend's server, passed as-is (backends that take them only). For
    ``sglang``: ``sglang.Engine`` (ServerArgs) arguments, e.g. ``mem_fraction_static``,
    ``cuda_graph_backend_decode``; ``enable_deterministic_inference: true`` makes SGLang honour the
    per-sample seeds (rollouts reproducible, somewhat slower). For ``embedded``, three (SGLang's names but the last):
    ``max_running_requests``: at most that many samples decode at once, the others wait and take the slots of
    ended ones (continuous batching; dense models only; unset: every sample of a call at once). Set it when a
    step's samples do not fit the GPU's memory together or have long-tailed lengths. ``chunked_prefill_size``: a
    prefill forward covers at most that many token slots (prompts x columns; dense models only; unset: one
    forward), so long prompts prefill in column chunks with bounded activations and attention mask (docs/engine.md).
    ``session_cache_size``: keep that many agent sessions' K/V across turns, so a turn prefills only its new
    tokens (``rollout.agent``; dense models only; 0, the default: none; log-probs are not bitwise the no-cache
    ones, docs/engine.md)."""


LossType = Literal["policy", "sft", "custom"]
"""``algorithm.loss_type``'s values."""
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
"""``algorithm.kl.estimator``'s values (rlrun/algo/kl.py)."""
TISMode = Literal["off", "clip", "mask"]
"""``algorithm.tis.mode``'s values (rlrun/algo/mismatch.py)."""
TISLevel = Literal["token", "sequence", "geometric"]
"""``algorithm.tis.level``'s values."""
Aggregation = Literal["token", "sample", "sequence"]
"""``algorithm.loss_aggregation``'s values (rlrun/algo/aggregate.py)."""
RoutingReplayMode = Literal["none", "trainer", "rollout"]
"""``algorithm.routing_replay``'s values (rlrun/megatron/routing_replay.py)."""


class KLConfig(Section):
    """KL to the reference model (``algorithm.ref``): a loss term or a reward penalty, never both."""

    loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL term added to the loss: ``loss += loss_coef * agg(kl(logp, logp_ref))``. 0 disables."""
    reward_coef: float = Field(0.0, ge=0)
    """Weight of the per-token KL penalty subtracted from the advantages / token rewards before training
    (``A_t -= reward_coef * kl_t``, KL of the old policy to the reference). 0 disables."""
    estimator: KLEstimator = "k3"
    """Per-token KL estimator (rlrun/algo/kl.py): k1 = log ratio, k2 = squared / 2, k3 = non-negative
    unbiased, low_var_kl = k3 clamped to [-10, 10]."""
    unbiased: bool = False
    """Weight the KL loss by the importance ratio pi / pi_old (DeepSeek-V3.2) so it stays unbiased off-policy."""


class RefConfig(Section):
    """The reference model: a CPU weight backup swapped into the trainer's model for its forward pass."""

    path: str | None = None
    """Hugging Face directory of the reference weights (same architecture as ``model.path``), or an rlrun
    checkpoint directory (``checkpoint.dir`` holding ``step_*``, or one ``step_*``; same model and parallel
    layout as this run); None uses the actor's initial weights."""
    step: int | None = Field(None, ge=0)
    """Which checkpoint of the rlrun checkpoint directory ``path`` to load (``step_N``); None the newest
    complete one. Only for checkpoint directories: Hugging Face weights have no steps."""
    update_interval: int | None = Field(None, ge=1)
    """Copy the actor's weights into the reference every N steps (after the optimizer step); None never."""

    @model_validator(mode="after")
    def _step_needs_path(self) -> RefConfig:
        if self.step is not None and self.path is None:
            raise ValueError(
                f"algorithm.ref.step ({self.step}) must come with algorithm.ref.path because it picks "
                f"a checkpoint of that directory; set ref.path to an rlrun checkpoint directory, "
                f"or unset ref.step"
            )
        return self


class TISConfig(Section):
    """Truncated importance sampling for the train/inference mismatch (rlrun/algo/mismatch.py)."""

    mode: TISMode = "off"
    """``clip``: weight the policy loss by clamp(pi_old / pi_rollout, clip_low, clip) (TIS); ``mask``:
    drop tokens (or sequences) whose ratio is outside [clip_low, clip] (IcePop); ``off``: no weighting."""

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare ``off`` as false: take it as ``"off"``."""
        return "off" if value is False else value

    level: TISLevel = "token"
    """One ratio per token, per sequence (product) or per sequence (geometric mean)."""
    clip: float = Field(2.0, gt=0)
    """Upper bound of the ratio."""
    clip_low: float = Field(0.0, ge=0)
    """Lower bound of the ratio (0 = truncate only from above)."""


class OPDConfig(Section):
    """On-policy distillation: a teacher swapped into the trainer's model (slime's ``megatron`` OPD), or a
    teacher engine beside each rank's engine (``teacher_engine``, slime's ``sglang`` OPD)."""

    teacher_path: str | None = None
    """Hugging Face directory of the teacher (same architecture as ``model.path``, unless ``teacher_engine``
    is set: then any size or architecture the engine runs, sharing ``model.path``'s tokenizer)."""
    teacher_engine: Literal["embedded", "sglang"] | None = None
    """Score the student's samples with a second engine worker per rank holding ``teacher_path`` (its
    log-probs of every response token, at the rollout temperature, over the whole vocabulary), during the
    rollout, instead of swapping the teacher into the trainer. The teacher worker keeps its weights resident
    (no release/resume between phases) and is watched like the engine (its death ends the job). A tokenizer
    other than ``model.path``'s is refused at setup. ``sglang``: prefill-only requests with
    ``logprob_start_len`` (slime's SGLang teacher), at ``rollout.temperature`` 1 only. None: the trainer-side
    swap."""
    teacher_server_args: dict[str, Any] = Field(default_factory=dict)
    """``sglang.Engine`` arguments of an SGLang teacher engine, e.g. ``mem_fraction_static``: the teacher's
    share of the GPU beside the student's engine and the trainer (give both engines' ``mem_fraction_static``
    so that they and the trainer fit). Must stay empty with the embedded teacher, which takes none."""
    kl_coef: float = Field(0.0, ge=0)
    """Advantage penalty ``A_t -= kl_coef * (logp_student - logp_teacher)``; > 0 enables distillation."""


class AlgoChoice(BaseModel):
    """An advantage estimator or a policy loss named with its own settings, e.g. ``{name: opsm, delta: 1e-3}``.

    The keys beside ``name`` are the entry's settings (docs/algorithms.md); they are checked against the
    entry's settings model in rlrun/algo by the preflight (names and settings live with the code).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    """The entry: an estimator for ``advantage_estimator``, a loss for ``policy_loss``."""


class AlgorithmConfig(Section):
    advantage_estimator: str | AlgoChoice = "grpo"
    """How advantages are computed: a name or ``{name: ..., <its settings>}`` (docs/algorithms.md). grpo / gspo /
    cispo: group-normalised reward; reinforce_plus_plus(_baseline): discounted token returns (with a group-mean
    baseline), need ``normalize_advantages``; rloo: leave-one-out group baseline; ppo: GAE, needs a critic.
    Each implies a ``policy_loss``."""
    policy_loss: str | AlgoChoice | None = None
    """The per-token policy term of ``loss_type: policy``, a name or ``{name: ..., <its settings>}``: ``ppo_clip``
    (PPO's clipped ratio), ``gspo`` (the clipped sequence ratio, arXiv 2507.18071), ``cispo`` (clipped, detached
    IS weight times logp, arXiv 2506.13585) (docs/algorithms.md lists every loss and its settings). None: the
    estimator's (gspo and cispo theirs, every other ppo_clip)."""
    normalize_std: bool = True
    """Shared default of the estimators' ``normalize_std`` setting (grpo, gspo, cispo): divide the group-centred
    reward by the group std (False gives Dr.GRPO)."""
    normalize_advantages: bool = False
    """Whiten the advantages over the whole step (all DP ranks, masked mean and unbiased std)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Shared default of the estimators' ``gamma`` setting: discount of REINFORCE++ returns and of GAE."""
    lambd: float = Field(1.0, ge=0, le=1)
    """Shared default of the ``ppo`` estimator's ``lambd`` setting: GAE's lambda."""
    custom_advantage: str | None = None
    """``module:function`` or ``file.py:function`` replacing the estimator, called per micro-batch as
    ``fn(cfg: AlgorithmConfig, mb: MicroBatch, kl: Tensor) -> (advantages, returns)`` ([B, S-1] each);
    ``mb.advantages`` holds each sample's group score broadcast over its response tokens."""
    loss_type: LossType = "policy"
    """policy: the clipped policy-gradient loss; sft: negative log-likelihood of the response tokens;
    custom: ``custom_loss``."""
    custom_loss: str | None = None
    """Loss for ``loss_type: custom``: ``fn(cfg, mb, logprobs, entropy, aggregate) -> (loss, metrics)``;
    ``aggregate(x)`` reduces a per-token tensor the configured way, metrics are summed tensors."""
    loss_aggregation: Aggregation = "token"
    """token: mean over the step's tokens; sample: mean per sample, then over samples; sequence: token
    sum per sample / ``rollout.max_new_tokens``, then mean over samples (Dr.GRPO)."""
    eps_clip: float = Field(0.2, gt=0)
    """Shared default of the losses' ``eps_clip`` setting: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Shared default of the losses' ``eps_clip_high`` setting: the upper clip range; None uses ``eps_clip``."""
    eps_clip_c: float | None = Field(None, gt=1)
    """Shared default of the losses' ``eps_clip_c`` setting (dual-clip, c > 1): the loss of a negative-advantage
    token is at most c * |A|. None disables."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: ``loss -= entropy_coef * agg(entropy)``."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as the old policy instead of recomputing them with the trainer."""
    keep_old_actor: bool = False
    """Keep a CPU copy of the weights last synced to the engine and take old log-probs from it."""
    skip_tied_groups: bool = True
    """Drop groups whose rewards are all equal before training (their advantage is zero)."""
    max_logprob_gap: float | None = Field(None, gt=0)
    """The on-policy gate: stop the run when a step's ``train/logprob_gap`` (token mean |trainer - engine|
    log-prob) exceeds this, and at step 0 unless the policy ratio is exactly 1 and the old-policy KL exactly
    0 (``train/abs_log_ratio``, ``train/approx_kl``). None: off. On CUDA in bf16 the embedded engine and the
    trainer agree bitwise on the gated runs (SmolLM2, a tiny Qwen3), so 1e-6 holds there; larger shapes may not
    (BENCHMARKS.md, "Step against peers": the log-prob gap column); in fp32 the two sides' kernels round apart
    (docs/on_policy.md); SGLang needs more."""
    rollout_data_postprocess: str | None = None
    """``fn(cfg: AlgorithmConfig, step: int, micro_batches: list[MicroBatch]) -> None`` called on every
    rank after advantages are computed and before training; may edit the micro-batches in place."""
    routing_replay: RoutingReplayMode = "none"
    """MoE models only (rlrun/megatron/routing_replay.py): ``trainer`` (R2) records the old-policy forward's
    expert choices and replays them in the training forward; ``rollout`` (R3) replays the engine's choices
    in every forward of the step (the engine records them; SGLang needs ``enable_return_routed_experts``)."""
    kl: KLConfig = KLConfig()
    ref: RefConfig = RefConfig()
    tis: TISConfig = TISConfig()
    opd: OPDConfig = OPDConfig()

    @property
    def estimator_name(self) -> str:
        choice = self.advantage_estimator
        return choice if isinstance(choice, str) else choice.name

    @property
    def estimator_settings(self) -> dict[str, Any]:
        """The settings written in ``advantage_estimator``'s mapping ({} for a bare name)."""
        choice = self.advantage_estimator
        return {} if isinstance(choice, str) else dict(choice.model_extra or {})

    @property
    def policy_loss_name(self) -> str | None:
        """``policy_loss``'s name; None when unset (rlrun.algo.specs then takes the estimator's)."""
        choice = self.policy_loss
        return choice if choice is None or isinstance(choice, str) else choice.name

    @property
    def policy_loss_settings(self) -> dict[str, Any]:
        """The settings written in ``policy_loss``'s mapping ({} for a bare name or None)."""
        choice = self.policy_loss
        return {} if choice is None or isinstance(choice, str) else dict(choice.model_extra or {})

    @property
    def uses_ref(self) -> bool:
        """Whether any term needs reference log-probs."""
        return self.kl.loss_coef > 0 or self.kl.reward_coef > 0

    @property
    def uses_teacher(self) -> bool:
        return self.opd.kl_coef > 0

    @property
    def swaps_teacher(self) -> bool:
        """Whether the teacher's weights are swapped into the trainer (not scored by a teacher engine)."""
        return self.uses_teacher and self.opd.teacher_engine is None

    @model_validator(mode="after")
    def _compatible(self) -> AlgorithmConfig:
        """Combinations of this section's own fields; what needs rlrun/algo's tables (names, settings, critic,
        whitening) is ``rlrun.algo.validate.algorithm_problems``, which ``rlrun.preflight`` runs."""
        for problem in self._term_problems():
            raise ValueError(problem)
        for problem in self._source_problems():
            raise ValueError(problem)
        return self

    def _term_problems(self):
        kl, tis = self.kl, self.tis
        if kl.loss_coef > 0 and kl.reward_coef > 0:
            yield (
                f"algorithm.kl.reward_coef ({kl.reward_coef}) must be 0 when algorithm.kl.loss_coef "
                f"({kl.loss_coef}) > 0 because the KL to the reference is either a loss term or a reward "
                f"penalty, not both; set one of them to 0"
            )
        if kl.unbiased and kl.loss_coef == 0:
            yield (
                "algorithm.kl.unbiased (True) must go with algorithm.kl.loss_coef > 0 because it re-weights "
                "the KL loss term; set algorithm.kl.loss_coef or unbiased: false"
            )
        if (self.ref.path is not None or self.ref.update_interval is not None) and not self.uses_ref:
            yield (
                "algorithm.ref must stay unset when no KL term is on because nothing would read the "
                "reference log-probs; set algorithm.kl.loss_coef or algorithm.kl.reward_coef > 0"
            )
        if self.policy_loss is not None and self.loss_type != "policy":
            yield (
                f"algorithm.policy_loss ({self.policy_loss_name}) must be unset with loss_type {self.loss_type} "
                f"because only loss_type policy has a policy term; remove policy_loss or set loss_type: policy"
            )
        if (self.loss_type == "custom") != (self.custom_loss is not None):
            yield (
                f"algorithm.custom_loss ({self.custom_loss}) must be set exactly when loss_type is custom "
                f"(it is {self.loss_type}); set both or neither"
            )
        if tis.clip_low >= tis.clip:
            yield (
                f"algorithm.tis.clip_low ({tis.clip_low}) must be < algorithm.tis.clip ({tis.clip}) "
                f"because they bound the importance ratio from below and above; lower clip_low"
            )

    def _source_problems(self):
        tis, opd = self.tis, self.opd
        if self.use_rollout_logprobs and tis.mode != "off":
            yield (
                f"algorithm.tis.mode ({tis.mode}) must be off with use_rollout_logprobs because the old "
                f"policy is then the rollout policy and the TIS ratio is 1; set one of them off"
            )
        if self.use_rollout_logprobs and self.keep_old_actor:
            yield (
                "algorithm.keep_old_actor (True) must be false with use_rollout_logprobs because the old "
                "log-probs come from the engine; set one of them to false"
            )
        if (opd.kl_coef > 0) != (opd.teacher_path is not None):
            yield (
                f"algorithm.opd.teacher_path ({opd.teacher_path}) and algorithm.opd.kl_coef ({opd.kl_coef}) "
                f"must be set together because distillation needs both a teacher and a weight; set both "
                f"or neither"
            )
        if opd.teacher_engine is not None and opd.kl_coef == 0:
            yield (
                f"algorithm.opd.teacher_engine ({opd.teacher_engine}) must come with algorithm.opd.kl_coef > 0 and "
                "teacher_path because without distillation no teacher is scored; set both or unset teacher_engine"
            )


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Adam learning rate: the peak of the schedule (the whole run's LR with the default constant style)."""
    min_lr: float = Field(0.0, ge=0)
    """Where ``linear`` and ``cosine`` decay end (reached after ``lr_decay_steps``); unused by ``constant``."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``lr`` (Megatron's: step ``s`` uses ``lr * s / warmup``,
    so the first step's LR is 0)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: ``constant`` keeps ``lr``; ``linear`` / ``cosine`` go from ``lr`` to ``min_lr`` by step
    ``lr_decay_steps`` (Megatron's OptimizerParamScheduler; its state is checkpointed)."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Step at which decay reaches ``min_lr``; None uses ``train.num_steps``. Must exceed ``lr_warmup_steps``."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: Adam state and fp32 main weights sharded over data-parallel ranks
    (reduce-scatter of gradients, all-gather of weights) instead of replicated on each."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    cpu_offload: bool = False
    """Keep Adam's state and the fp32 main weights in host memory and step them there (Megatron's
    ``optimizer_cpu_offload``: its HybridDeviceOptimizer with torch's AdamW on the CPU, gradients copied device-to-host
    and updated weights back on side streams, overlapped per parameter). The device then holds only the bf16 weights and
    the fp32 gradient buffers (6 bytes per parameter instead of 18: what lets an 8B model's training state fit one GPU);
    the step costs host bandwidth and CPU Adam time. Needs CUDA (on CPU the state is in host memory already),
    ``use_distributed_optimizer`` and ``model.dtype`` bfloat16."""
    offload_fraction: float = Field(1.0, gt=0, le=1)
    """With ``cpu_offload``: the fraction of the parameters (by count, in order) whose optimizer state goes to
    host memory; the rest stays on the device and is stepped there."""

    @model_validator(mode="after")
    def _offload_has_its_requirements(self) -> OptimizerConfig:
        if self.cpu_offload and not self.use_distributed_optimizer:
            raise ValueError(
                "optimizer.cpu_offload (true) must go with optimizer.use_distributed_optimizer because Megatron "
                "offloads the distributed optimizer's state shards only; set optimizer.use_distributed_optimizer: true"
            )
        if self.offload_fraction != 1.0 and not self.cpu_offload:
            raise ValueError(
                f"optimizer.offload_fraction ({self.offload_fraction}) must be left at 1.0 without "
                "optimizer.cpu_offload because nothing is offloaded then; set optimizer.cpu_offload: true or remove it"
            )
        return self


class TrainConfig(Section):
    num_steps: int = Field(60, ge=1)
    """Number of rollout + train steps."""
    max_tokens_per_micro_batch: int = Field(2048, ge=16)
    """Token budget of one micro-batch (prompt + response, after padding) per DP rank."""
    seed: int = 1234
    """Seeds data order, sampling and initialisation."""
    updates_per_rollout: int = Field(1, ge=1)
    """Optimizer updates per rollout (slime's ``--num-steps-per-rollout``): the step's kept groups are split,
    in order, into this many parts of whole groups, each one actor update (and one critic update) normalised
    by its own global token and sample counts. Old-policy, reference and teacher log-probs, values and
    advantages are computed once over the whole rollout before the first update, so from the second update
    on the policy ratio moves off 1 and the PPO clip can bind. A step that keeps fewer groups trains one
    update per kept group. The LR schedule counts updates."""
    epochs_per_rollout: int = Field(1, ge=1)
    """Passes over the rollout's updates (verl's ``ppo_epochs``): each pass runs every update again, in order."""
    recompute: RecomputeMode = "none"
    """Activation recompute of the trainer's layers (rlrun/megatron/recompute.py), for long responses:
    ``selective`` recomputes the core attention and the dense MLP in the backward (keeps their inputs only;
    ~25-30% more FLOPs), ``full`` whole layers (keeps each layer's input only; ~33% more); ``none`` keeps
    every activation (fastest). Same numbers either way. ``rlrun doctor CONFIG`` estimates what each keeps."""
    recompute_num_layers: int | None = Field(None, ge=1)
    """With ``recompute: full``: recompute only the first N layers of each pipeline stage (the rest keep
    their activations); None recomputes every layer."""

    @model_validator(mode="after")
    def _num_layers_needs_full(self) -> TrainConfig:
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ValueError(
                f"train.recompute_num_layers ({self.recompute_num_layers}) must be unset with train.recompute "
                f"{self.recompute} because only full recompute counts layers; set train.recompute: full or remove it"
            )
        return self

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates one rollout step takes (updates x epochs): what the LR schedule counts."""
        return self.updates_per_rollout * self.epochs_per_rollout


class CheckpointConfig(Section):
    save_interval: int = Field(0, ge=0)
    """Save every N steps as well (and after the last step); 0: no periodic checkpoints, only ``save_at_end``'s.
    SIGTERM or SIGUSR1 (Slurm preemption or time limit) always checkpoints before exiting."""
    save_at_end: bool = True
    """Checkpoint after the last step (``step_N``, resumable), so a finished run keeps its trained state; false
    keeps only ``save_interval``'s and the stop checkpoints."""
    export_at_end: bool = True
    """When the run ends (the last step, or stopped by SIGTERM / SIGUSR1) write the policy as a Hugging Face
    directory, ``RUN_DIR/model`` (safetensors in the trainer's dtype, config and tokenizer files:
    ``AutoModelForCausalLM.from_pretrained`` loads it), and with ``model.lora`` its adapters in PEFT's format,
    ``RUN_DIR/model/adapter`` (the safetensors hold the merged weights). Written through a temporary directory,
    so a reader never sees half of one. False: no export (``rlrun convert mcore-to-hf`` makes one from a
    checkpoint later)."""
    dir: str | None = None
    """Where checkpoints go (one ``step_NNNNNN`` directory each); None uses ``RUN_DIR/checkpoints``.
    Must be on a filesystem every node sees: each rank writes its own shard."""
    resume: str = Field("auto", min_length=1)
    """``auto``: continue from the newest complete checkpoint in ``dir`` (else from ``load``, else fresh);
    ``none``: ignore ``dir``'s checkpoints; or the path of one checkpoint directory. A checkpoint loads at
    any data-parallel size, with the tensor- and pipeline-parallel sizes that saved it."""
    load: str | None = None
    """A checkpoint to start from when ``resume`` finds none of the run's own: a ``step_*`` directory or a
    directory holding them (full resume: model, optimizer, LR schedule, data position, step), or the output
    of ``rlrun convert hf-to-mcore`` (weights only: training starts at step 0)."""
    keep_last: int = Field(0, ge=0)
    """Keep only the newest N complete checkpoints (older ones are deleted after each save); 0 keeps all."""
    async_save: bool = False
    """Write periodic checkpoints in a background thread while training goes on (costs one host-memory
    copy of the model and optimizer shards); the checkpoint is committed at a later step once every
    rank has written. The last and the stop checkpoints are always written synchronously."""


class LoggingConfig(Section):
    run_dir: str = Field("runs/run", min_length=1)
    """Directory for metrics.jsonl, the resolved config, checkpoints, the exported model, engine sockets and worker
    logs. Unset: ``runs/<the YAML file's name without .yaml>`` (``runs/quickstart`` for configs/quickstart.yaml);
    ``runs/run`` for a config given to ``rlrun.train`` as a Python dict. A run resumes from the checkpoints found
    here (``checkpoint.resume``), so two different runs need two directories."""
    log_samples: int = Field(0, ge=0)
    """Write this many of each step's samples (prompt, response, reward, finish reason) to
    ``RUN_DIR/samples.jsonl``, one JSON line each, and, with ``wandb_project``, as a W&B table ``samples``;
    0: none."""
    console: bool = True
    """Print a one-line summary per step on rank 0 (and, in a terminal, a live progress bar naming the
    current phase)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to ``RUN_DIR/tensorboard`` (needs the ``tensorboard`` package:
    ``pip install 'rlrun[logging]'``)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs ``wandb``; ``WANDB_MODE=offline`` works
    without a network). None disables it."""
    profile_steps: tuple[int, ...] = ()
    """0-based steps to record with the torch profiler; each profiled rank writes a Chrome trace to
    ``RUN_DIR/profile/step_<N>-rank_<R>.json`` (open in Perfetto or chrome://tracing)."""
    profile_ranks: tuple[int, ...] = (0,)
    """Global ranks that record ``profile_steps``."""


class OffloadConfig(Section):
    colocate: bool = False
    """Each rank's engine shares its GPU with the trainer (slime's ``--colocate``): turns ``train`` and
    ``rollout`` on unless they are set explicitly."""
    train: bool = False
    """Put the trainer to sleep (torch_memory_saver) while the engine generates. No-op on CPU."""
    rollout: bool = False
    """Release engine memory while the trainer trains. No-op on CPU."""
    memory_margin_gb: float = Field(1.0, ge=0)
    """Device memory (GB) that allocations in the trainer's offload region must leave free: one that
    would leave less fails as out-of-memory instead of taking what the engine needs to resume
    (torch_memory_saver's margin). 0 turns the check off."""
    optimizer_copy: OptimizerCopy = "overlapped"
    """With ``train`` on CUDA, how the optimizer's state (fp32 main weights, Adam moments) goes to the host and back:
    ``overlapped`` copies it with the offloader's own copy, back on a side stream behind the next forward pass
    (rlrun/trainer/optimizer_state.py); ``with_weights`` leaves it to torch_memory_saver's copy with the weights,
    which holds back the forward pass until it is done (torch's Adam only; Megatron's host Adam always takes this
    path). No-op on CPU."""
    release_cache: ReleaseCache = "when_needed"
    """With ``train`` on CUDA, what the sleeping trainer does with the blocks torch's allocator keeps cached for its
    activations (tens of GB): ``when_needed`` keeps them when the device, with the trainer's state paused, has room
    for what the engine took during the previous rollout (its KV cache, graphs and temporaries, a tenth over, plus
    ``memory_margin_gb``), so the next train phase does not map them again; ``always`` returns them to the driver
    at every sleep. The first sleeps, before a rollout was measured, always return them. No-op on CPU."""
    teardown_nccl: bool = True
    """With ``train`` on CUDA: destroy the NCCL communicator of each of Megatron's groups of more than one
    rank (each holds device memory outside torch's allocator) while the trainer sleeps and rebuild them at wake,
    keeping the group objects; its one-rank groups answer their collectives without one
    (rlrun/runtime/reloadable_groups.py). gloo groups and the default group stay. No-op on CPU. What the sleeping
    trainer keeps with and without it: BENCHMARKS.md, "Offload: trainer and engine taking turns on one GPU"."""

    @model_validator(mode="before")
    @classmethod
    def _colocate_turns_offload_on(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("colocate"):
            data = {"train": True, "rollout": True, **data}
        return data

    @property
    def reloadable_backends(self) -> tuple[str, ...]:
        """Backends whose groups ``init_distributed`` makes reloadable: NCCL's when this config tears
        them down (on CPU no group is NCCL, so nothing changes there)."""
        return ("nccl",) if self.train and self.teardown_nccl else ()


class CriticConfig(Section):
    """PPO's value model (rlrun/trainer/critic.py): on the actor's ranks, trained first each step on the clipped
    value loss; its values feed GAE in-process."""

    config: str | None = None
    """YAML file listing the models (roles actor and critic) and the critic's overrides of the actor's
    ``model`` / ``optimizer`` settings (rlrun/config/critic.py; example: configs/critic/smollm2.yaml). None: no
    critic. Needs ``algorithm.advantage_estimator: ppo`` or an ``algorithm.custom_advantage`` that reads
    ``mb.values``."""
    num_critic_only_steps: int = Field(0, ge=0)
    """Train only the critic for the first N steps (the actor stays put while the values settle)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value loss: the new value may move at most this far from the value GAE used
    (rlrun/algo/value_loss.py). None: the unclipped squared error."""


class PlacementConfig(Section):
    """Where engines run (docs/async.md, "Disaggregated placement"): beside every trainer rank (colocated, the
    default) or on torchrun ranks of their own."""

    engine_ranks: int = Field(0, ge=0)
    """The last N torchrun ranks host engines only (rlrun/rollout/engine_rank.py): no Megatron model, one engine
    per ``engine.tp`` consecutive engine ranks (which must divide N), grouped as colocated ranks are; the other
    ranks train, and Megatron's world is theirs alone. Rank 0 sends each engine group's leader prompts and gets
    finished, scored groups back over torch.distributed (gloo), and broadcasts the trained weights to every
    engine rank in ``engine.bucket_bytes`` buckets (NCCL on GPUs, gloo on CPU). Each round's prompts are split
    and seeded per training rank as colocated ranks' would be, so M training ranks with M or fewer engine
    ranks train what M colocated ranks with the same ``engine.tp`` train. With ``rollout.max_staleness`` 1
    they generate step n+1 while the trainers train step n. 0: every rank trains and drives its own engine."""


class RunConfig(Section):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig
    rollout: RolloutConfig
    eval: EvalConfig = EvalConfig()
    debug: DebugConfig = DebugConfig()
    engine: EngineConfig = EngineConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    offload: OffloadConfig = OffloadConfig()
    critic: CriticConfig = CriticConfig()
    placement: PlacementConfig = PlacementConfig()

    @model_validator(mode="after")
    def _context_parallel_without_critic(self) -> RunConfig:
        if self.parallel.cp > 1 and self.critic.config is not None:
            raise ValueError(
                f"parallel.cp ({self.parallel.cp}) must be 1 with critic.config because the critic's values are not "
                "gathered over the context-parallel ranks; set parallel.cp: 1 or remove critic.config"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_kernel(self) -> RunConfig:
        kernel = self.model.packed_attention
        if self.parallel.cp > 1 and kernel in BF16_KERNEL_ATTENTION:
            raise ValueError(
                f"model.packed_attention ({kernel}) would have no effect with parallel.cp ({self.parallel.cp}) "
                "because context-parallel attention runs the memory-efficient kernel on its chunks "
                "(rlrun/megatron/context_parallel.py); set model.packed_attention: auto or parallel.cp: 1"
            )
        return self

    @model_validator(mode="after")
    def _max_staleness_fits(self) -> RunConfig:
        """``rollout.max_staleness`` > 0 against the options the background rollout thread cannot serve."""
        k = self.rollout.max_staleness
        if k == 0:
            return self
        refused = {
            "algorithm.max_logprob_gap": (
                self.algorithm.max_logprob_gap is not None,
                "the trainer's log-probs are the live weights' while the samples come from weights up to "
                f"{k} updates older, so the gap measures the policy's change, not a kernel difference; unset it "
                "and watch train/mismatch_k3",
            ),
            "engine.tp": (self.engine.tp > 1, "the rollout thread drives a single-rank engine; set engine.tp: 1"),
            "engine.sync_interval": (
                self.engine.sync_interval > 1,
                "max_staleness already bounds the sampling weights' age; set engine.sync_interval: 1",
            ),
            "offload.train / offload.rollout / offload.colocate": (
                self.offload.train or self.offload.rollout or self.offload.colocate,
                "the engine generates while the trainer trains, so both stay resident; turn them off",
            ),
            "rollout.partial_rollout / rollout.abort_surplus": (
                self.rollout.streams,
                "a streamed round's carry is not checkpointed with the batches generated ahead; turn them off",
            ),
        }
        if self.rollout.continue_after_tokens is not None:
            refused |= self._continuation_refusals()
        for key, (bad, reason) in refused.items():
            if bad:
                raise ValueError(f"{key} must be off with rollout.max_staleness ({k}) because {reason}")
        return self

    @model_validator(mode="after")
    def _continuation_fits(self) -> RunConfig:
        k, n = self.rollout.max_staleness, self.rollout.continue_after_tokens
        if n is not None and k < 2:
            raise ValueError(
                f"rollout.continue_after_tokens ({n}) must come with rollout.max_staleness >= 2 (it is {k}) "
                "because a rollout continues under the update published while it runs, which with K = 1 is the "
                "one its own batch trains on (nothing would overlap) and with K = 0 never comes; raise "
                "rollout.max_staleness or set rollout.continue_after_tokens: null"
            )
        if n is not None and n >= self.rollout.max_new_tokens:
            raise ValueError(
                f"rollout.continue_after_tokens ({n}) must be below rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}) because no response is longer than that, so none would "
                "continue; lower it or set it to null"
            )
        return self

    def _continuation_refusals(self) -> dict[str, tuple[bool, str]]:
        """What ``rollout.continue_after_tokens`` cannot cut at a token boundary and continue."""
        r = self.rollout
        return {
            "rollout.generate_fn / rollout.agent / rollout.rollout_fn": (
                any(hook is not None for hook in (r.generate_fn, r.agent, r.rollout_fn)),
                "with rollout.continue_after_tokens a response is cut at a token boundary and continued from "
                "its tokens, which a multi-turn trajectory or a rollout function's own generation cannot be; "
                "unset them or set rollout.continue_after_tokens: null",
            ),
            "placement.engine_ranks": (
                self.placement.engine_ranks > 0,
                "rollout.continue_after_tokens continues samples on the colocated engine between two weight "
                "pushes, which engine ranks do not serve; set placement.engine_ranks: 0 or "
                "rollout.continue_after_tokens: null",
            ),
        }

    @model_validator(mode="after")
    def _placement_fits(self) -> RunConfig:
        """``placement.engine_ranks`` > 0 against the options an engine rank does not serve."""
        n = self.placement.engine_ranks
        if n == 0:
            return self
        if n % self.engine.tp:
            raise ValueError(
                f"engine.tp ({self.engine.tp}) must divide placement.engine_ranks ({n}) because every engine rank "
                "belongs to one engine group of engine.tp ranks; set placement.engine_ranks to a multiple of "
                "engine.tp"
            )
        o, r = self.offload, self.rollout
        refused = [  # (key, its value, what it must be, why)
            (
                "offload.train / offload.rollout / offload.colocate",
                o.train or o.rollout or o.colocate,
                "off",
                "trainer and engines sit on different ranks, so nothing takes turns",
            ),
            (
                "rollout.partial_rollout / rollout.abort_surplus",
                r.streams,
                "off",
                "streaming rounds call each rank's own engine, and the training ranks have none",
            ),
            (
                "algorithm.opd.teacher_engine",
                self.algorithm.opd.teacher_engine,
                "unset",
                "the teacher scores each rank's own samples, and the training ranks sample none",
            ),
            ("eval.interval", self.eval.interval, "0", "eval generates on engines the training ranks do not have"),
        ]
        for key, value, want, reason in refused:
            if value not in (None, False, 0) and str(value) != want:
                fix = "turn them off" if " / " in key else f"set {key}: {'null' if want == 'unset' else want}"
                raise ValueError(
                    f"{key} ({value}) must be {want} with placement.engine_ranks ({n}) because {reason}; "
                    f"{fix}, or placement.engine_ranks: 0"
                )
        return self

    @model_validator(mode="after")
    def _sync_interval_fits(self) -> RunConfig:
        """``engine.sync_interval`` against the options that read the weights the engine holds."""
        algo, interval = self.algorithm, self.engine.sync_interval
        if algo.keep_old_actor and interval == 1:
            raise ValueError(
                "algorithm.keep_old_actor (true) has no effect with engine.sync_interval 1 because the engine "
                "then holds the live weights at every step's start, so the old actor would be a second copy of "
                "them and its forward a redundant one; set engine.sync_interval > 1 or keep_old_actor: false"
            )
        if interval > 1 and self.engine.max_restarts:
            raise ValueError(
                f"engine.max_restarts ({self.engine.max_restarts}) must be 0 with engine.sync_interval {interval} "
                "because a restarted engine is given the live weights, which the other ranks' engines hold only "
                "after the next sync; set engine.max_restarts: 0 or engine.sync_interval: 1"
            )
        save = self.checkpoint.save_interval
        if interval > 1 and save % interval:
            raise ValueError(
                f"checkpoint.save_interval ({save}) must be a multiple of engine.sync_interval ({interval}) because "
                "a resume syncs the restored weights to the engine, which the uninterrupted run does only at sync "
                f"steps, so only checkpoints taken there resume exactly; set checkpoint.save_interval: "
                f"{interval * max(1, save // interval)}"
            )
        stale_old_logprobs = interval > 1 and not (algo.keep_old_actor or algo.use_rollout_logprobs)
        if algo.max_logprob_gap is not None and stale_old_logprobs:
            raise ValueError(
                f"algorithm.max_logprob_gap ({algo.max_logprob_gap}) must be unset with engine.sync_interval "
                f"{interval} unless algorithm.keep_old_actor is true, because the old log-probs are then the live "
                "weights' while the engine samples with weights synced up to "
                f"{interval - 1} steps earlier, and the gate would stop the first step between syncs; "
                "set algorithm.keep_old_actor: true"
            )
        if algo.max_logprob_gap is not None and self.rollout.partial_rollout:
            raise ValueError(
                f"algorithm.max_logprob_gap ({algo.max_logprob_gap}) must be unset with rollout.partial_rollout "
                "because a carried group was sampled by earlier weights (a finished group beyond the batch wholly, "
                "a continued sample's first tokens), so its gap to the training weights is the policy's change, "
                "not a kernel difference, and the gate would stop the first step that trains one; correct it with "
                "algorithm.tis or rollout.partial_rollout_mask_offpolicy and unset algorithm.max_logprob_gap"
            )
        return self

    @model_validator(mode="after")
    def _rollout_fits_the_step(self) -> RunConfig:
        if self.rollout.streams and self.engine.tp > 1:
            raise ValueError(
                f"engine.tp ({self.engine.tp}) must be 1 with rollout.abort_surplus / rollout.partial_rollout "
                "because streaming rounds send one call per group from each rank to its own engine; set "
                "engine.tp: 1 or turn them off"
            )
        if self.algorithm.opd.teacher_engine is not None and self.engine.tp > 1:
            raise ValueError(
                f"engine.tp ({self.engine.tp}) must be 1 with algorithm.opd.teacher_engine because each rank's "
                "teacher engine scores that rank's own samples; set engine.tp: 1 or unset teacher_engine"
            )
        if self.train.updates_per_rollout > self.rollout.prompts_per_step:
            raise ValueError(
                f"train.updates_per_rollout ({self.train.updates_per_rollout}) must be <= rollout.prompts_per_step "
                f"({self.rollout.prompts_per_step}) because each update trains whole groups; lower it or draw "
                "more prompts per step"
            )
        if self.rollout.rollout_fn is not None and self.debug.load_rollout_data:
            raise ValueError(
                f"rollout.rollout_fn ('{self.rollout.rollout_fn}') must be unset with debug.load_rollout_data "
                "because the loaded batches replace every rollout, so the function would never run; unset one"
            )
        if self.engine.max_restarts and self.rollout.streams:
            raise ValueError(
                f"engine.max_restarts ({self.engine.max_restarts}) must be 0 with rollout.abort_surplus / "
                "rollout.partial_rollout because streaming rounds call the engine from their own threads, "
                "where a lost engine cannot be told from a failed round; set engine.max_restarts: 0 or "
                "turn streaming off"
            )
        return self

    @model_validator(mode="after")
    def _lora_reference(self) -> RunConfig:
        ref = self.algorithm.ref
        if self.model.lora is None:
            return self
        for key, value in (("path", ref.path), ("update_interval", ref.update_interval)):
            if value is not None:
                raise ValueError(
                    f"algorithm.ref.{key} ({value}) must be unset with model.lora because the LoRA reference is "
                    "the frozen base model (adapters off), never a weight copy; unset it, or unset model.lora"
                )
        return self

    @property
    def uses_critic(self) -> bool:
        return self.critic.config is not None
