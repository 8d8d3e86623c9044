"""Every engine setting, grouped by the part of the engine that reads it.

Field names are unique across the groups so that a flat `LLM(max_num_seqs=4)` keyword, a flat
YAML key and a `--max-num-seqs` flag all name the same field. Where vLLM has the setting we use
vLLM's name. Over 300 lines: one schema, each group beside the others it is validated with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raylm.configs.kv_transfer import KVTransferConfig, RoutingConfig
from raylm.configs.pooler_config import PoolerConfig
from raylm.configs.structured_outputs_config import StructuredOutputsConfig

if TYPE_CHECKING:
    from raylm.configs.bundles import EngineBundles
    from raylm.configs.cudagraph_plan import CUDAGraphPlan
    from raylm.configs.kv_identity import KVIdentity
    from raylm.configs.model_info import ModelInfo


class _Section(BaseModel):
    # Frozen: a decision is made once (raylm/configs/resolve.py) and every layer reads it; a change is
    # a copy.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    model: str | None = Field(None, description="HF checkpoint folder or .gguf file; None: the default model")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model folder)")
    served_model_name: str | None = Field(None, description="model id shown by the API")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens per request")
    seed: int = Field(0, description="seed for requests that give none")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    quantization: Literal["none", "int8", "int4", "gguf", "compressed-tensors", "gptq", "awq"] | None = Field(
        None, description="weights kept quantized: int8 (Q8_0 blocks) or int4 (Q4_1) from a float checkpoint, gguf "
                          "(a GGUF file's own Q4_0/Q4_1/Q8_0), compressed-tensors / gptq / awq (a checkpoint's "
                          "quantization_config), none (float; a GGUF file dequantized); None: gguf for a .gguf "
                          "model, the checkpoint's format for a quantized one, else none")


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_gib: float = Field(1.0, gt=0.0, description="KV cache size on CPU")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="force the KV block count")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "cpu", "triton", "flash_attn"] = Field(
        "auto", description="attention kernel; auto: cpu (raylm's kernels) for float32 and bfloat16 on CPU; on CUDA "
                            "flash_attn (installed, 16-bit, block_size a multiple of 256), else triton (installed), "
                            "else torch")


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1, description="engine replicas, each a Ray actor with its own workers")
    data_parallel_backend: Literal["ray"] = Field("ray", description="how DP engines run: one Ray actor each")
    enable_expert_parallel: bool = Field(
        False, description="MoE: split the experts over the DP x TP ranks of a stage instead of sharding each by TP")
    distributed_executor_backend: Literal["uni", "ray"] | None = Field(
        None, description="None: uni for one device, ray for more")
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    pp_layer_partition: list[int] | None = Field(None, description="layers per PP stage")
    enable_dbo: bool = Field(
        False, description="dual batch overlap: split a forward in two micro-batches whose expert all_to_alls overlap "
                           "the other's compute (lock-step DP with expert parallel only)")
    dbo_decode_token_threshold: int = Field(
        32, ge=1, description="enable_dbo: least tokens of a decode-only batch that is split in micro-batches")
    dbo_prefill_token_threshold: int = Field(
        512, ge=1, description="enable_dbo: least tokens of a batch with prefills that is split in micro-batches")

    @property
    def world_size(self) -> int:
        """Devices of one engine (one DP rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class SchedulerConfig(_Section):
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    max_num_seqs: int = Field(128, ge=1, description="requests running at once")
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="0: off; else the most prompt tokens one request computes in a step (chunked prefill), "
                             "so a long prompt joins the running decodes in slices instead of one long step")
    max_prefill_tokens_with_decodes: int | None = Field(
        None, ge=0, description="the most prompt tokens a step computes while it also decodes running requests, so "
                                "those streams wait at most that chunk's time for their next token (chunked "
                                "prefill); 0: off; None: decided at resolution (configs/scheduler_defaults.py: 32 "
                                "for a server on CPU, else off)")
    async_scheduling: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    @model_validator(mode="after")
    def _chunks_need_chunked_prefill(self) -> SchedulerConfig:
        if self.max_prefill_tokens_with_decodes and not self.enable_chunked_prefill:
            raise ValueError(f"max_prefill_tokens_with_decodes ({self.max_prefill_tokens_with_decodes}) slices "
                             f"prompts over steps: it needs enable_chunked_prefill (or set it to 0)")
        return self


CUDAGraphModeName = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


class CompilationConfig(_Section):
    enforce_eager: bool = Field(
        False, description="never capture CUDA graphs (cudagraph_mode NONE); on CPU, run the decoder layers module "
                           "by module (no CPU layer stack)")
    cudagraph_mode: CUDAGraphModeName | None = Field(
        None, description="vLLM's modes; None: FULL_DECODE_ONLY on CUDA, NONE on CPU unless capture sizes are given")
    cudagraph_capture_sizes: list[int] | None = Field(
        None, description="batch sizes (tokens) to capture; default 1, 2, 4, then steps of 8 (16 past 256) up to "
                          "max_cudagraph_capture_size")
    max_cudagraph_capture_size: int | None = Field(
        None, ge=1, description="largest capture size; default max_num_seqs (at most 512)")
    custom_ops: Literal["auto", "none"] = Field(
        "auto", description="none: plain torch ops everywhere, no compiled CPU kernels")


class ServingConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0.0)
    upscale_delay_s: float = Field(30.0, ge=0.0, description="Serve autoscaling: load held this long adds replicas")
    downscale_delay_s: float = Field(600.0, ge=0.0, description="Serve autoscaling: idle this long drops replicas")


class ObservabilityConfig(_Section):
    disable_log_stats: bool = Field(False, description="no periodic engine stats line in the log")
    log_batch_execution: bool = Field(
        False, description="log each forward's batch decision: cudagraph mode, padding, micro-batches, DP tokens")
    log_stats_interval_s: float = Field(10.0, gt=0.0, description="seconds between engine stats lines")
    record_forwards: bool = Field(
        False, description="keep each forward's graph key (padded size, cudagraph mode, replayed or not) for the "
                           "workers' cuda_graph_report (scripts/gpu_proof.py); off, the hot path records nothing")
    trace_file: str | None = Field(None, description="write a Chrome trace of every step's phases on every rank here")


class SpeculativeConfig(_Section):
    """vLLM's speculative_config, given whole (a dict in YAML and keywords, JSON on the command line): it is a section
    of its own, not flat fields, because its `model` is the draft's, not the target's."""

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup in the request's own tokens; draft_model: a smaller checkpoint with the "
                    "target's vocabulary")
    num_speculative_tokens: int = Field(ge=1, description="draft tokens proposed per request and step (k)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest suffix matched (default: max)")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest suffix matched (default: min, or 5)")
    model: str | None = Field(None, description="draft_model: the draft checkpoint folder")
    draft_tensor_parallel_size: int | None = Field(
        None, ge=1, description="draft_model: its TP size; it runs on the target's workers, so the target's")


class LoRAConfig(_Section):
    enable_lora: bool = Field(False, description="serve LoRA adapters (PEFT checkpoints) beside the base model")
    max_loras: int = Field(1, ge=1, description="enable_lora: adapters in one batch (the device slots)")
    max_lora_rank: int = Field(16, ge=1, description="enable_lora: the largest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="enable_lora: adapters kept in host memory, least recently used evicted; "
                                "default max_loras")
    lora_modules: list[str] | None = Field(
        None, description="enable_lora: adapters registered at start-up, each name=path (a PEFT folder)")
    dynamic_lora_loading_path: str | None = Field(
        None, description="enable_lora: a folder of PEFT adapters (one sub-folder each, named as the adapter); a "
                          "request naming one that is not loaded loads it (the OpenAI server, Ray Serve)")


SECTIONS: dict[str, type[BaseModel]] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "parallel_config": ParallelConfig,
    "scheduler_config": SchedulerConfig,
    "compilation_config": CompilationConfig,
    "serving_config": ServingConfig,
    "observability_config": ObservabilityConfig,
    "kv_transfer_config": KVTransferConfig,
    "routing_config": RoutingConfig,
    "lora_config": LoRAConfig,
    "structured_outputs_config": StructuredOutputsConfig,
}


@dataclass(frozen=True)
class ResolvedConfig:
    """Every decision resolution makes (configs/resolve.py: resolve_config), once, from the settings, the
    checkpoint's facts and the environment's; every layer reads these fields and decides nothing again
    (docs/architecture.md, "Where each decision is made")."""

    model_info: ModelInfo
    device: str  # "cpu" or "cuda"
    dtype: str  # of the weights' compute and the KV cache: float32, float16 or bfloat16
    quantization: str  # none, int8, int4 or gguf
    attention_backend: str  # torch, cpu, triton or flash_attn
    executor_backend: str  # "uni" (the worker in the engine's process) or "ray" (worker actors)
    cudagraph: CUDAGraphPlan  # the mode in effect and the padded sizes of uniform decode batches
    dp_lockstep: bool  # data-parallel engines step together (MoE with expert parallel over DP > 1)
    uniform_decode_query_len: int  # query rows per request of a decode step: 1 + speculative tokens
    max_concurrent_batches: int  # steps the engine keeps in flight
    bundle_layout: EngineBundles  # one engine's placement group (used where it runs Ray workers, or DP engines)
    num_ray_bundles: int  # bundles of all engines: the CPUs a local Ray started for them declares at least
    routing_policy: str  # "load" or "prefix", over DP engines and Serve replicas
    # Grammar backends a constraint is tried against, in order (structured_outputs_backend; auto: xgrammar, then
    # guidance).
    structured_outputs_backends: tuple[str, ...]
    # What decides the values of the KV this engine computes (model, dtype, quantization): the KV connectors share
    # KV only between engines whose identities are equal.
    kv_identity: KVIdentity
    draft_model_info: ModelInfo | None = None  # speculative_config's draft checkpoint (method draft_model only)


@dataclass(frozen=True)
class EngineConfig:
    """All sections together; a plain dataclass so that the vLLM names (`model_config`, ...) stay
    free of pydantic's reserved `model_config`. Cross-section rules are checked here. `resolution` is None in the
    settings as given; resolve_config (configs/resolve.py) sets it, and the engine's layers read `resolved`."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    serving_config: ServingConfig = field(default_factory=ServingConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    routing_config: RoutingConfig = field(default_factory=RoutingConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    pooler_config: PoolerConfig | None = None  # None: the checkpoint's (configs/pooler_config.py)
    resolution: ResolvedConfig | None = None

    @property
    def resolved(self) -> ResolvedConfig:
        """The decisions; settings not resolved yet are a programming error (resolve_engine_config first)."""
        if self.resolution is None:
            raise RuntimeError("this engine config is not resolved: raylm.cluster.engine.config_resolver."
                               "resolve_engine_config(config) decides it (configs/resolve.py)")
        return self.resolution

    @property
    def model_info(self) -> ModelInfo:
        return self.resolved.model_info

    def __post_init__(self) -> None:
        sched, parallel = self.scheduler_config, self.parallel_config
        max_len = self.model_config.max_model_len
        if sched.long_prefill_token_threshold and not sched.enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold ({sched.long_prefill_token_threshold}) slices prompts "
                             f"over steps: it needs enable_chunked_prefill (or set it to 0)")
        if max_len is not None and not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_len}) when enable_chunked_prefill is False: a prompt must fit in one step")
        if parallel.pp_layer_partition is not None:
            if len(parallel.pp_layer_partition) != parallel.pipeline_parallel_size:
                raise ValueError(
                    f"pp_layer_partition has {len(parallel.pp_layer_partition)} entries; it needs one per "
                    f"pipeline stage (pipeline_parallel_size={parallel.pipeline_parallel_size})")
            if min(parallel.pp_layer_partition) < 1:
                raise ValueError("pp_layer_partition: every stage needs at least 1 layer")
        if parallel.enable_dbo and not (parallel.data_parallel_size > 1 and parallel.enable_expert_parallel):
            raise ValueError(
                f"enable_dbo needs data_parallel_size > 1 with enable_expert_parallel (micro-batches overlap the "
                f"expert all_to_all of lock-step DP ranks); got data_parallel_size={parallel.data_parallel_size}, "
                f"enable_expert_parallel={parallel.enable_expert_parallel}")
        self._check_cudagraph_sizes()
        mode = self.compilation_config.cudagraph_mode
        if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            raise ValueError(
                f"cudagraph_mode {mode}: raylm captures FULL graphs of uniform decode batches only; piecewise graphs "
                f"need torch.compile's graph splitting, which raylm does not build. Use FULL_DECODE_ONLY (or FULL, "
                f"the same here), or NONE")
        if self.cache_config.attention_backend == "cpu" and self.compilation_config.custom_ops == "none":
            raise ValueError("attention_backend 'cpu' needs raylm's CPU kernels, which custom_ops='none' turns off")
        tools = self.structured_outputs_config
        if tools.enable_auto_tool_choice != (tools.tool_call_parser is not None):
            raise ValueError("enable_auto_tool_choice and tool_call_parser go together: tool_choice 'auto' parses "
                             "the model's calls with that parser (--enable-auto-tool-choice --tool-call-parser hermes)")
        if self.serving_config.min_replicas > self.serving_config.max_replicas:
            raise ValueError(
                f"min_replicas ({self.serving_config.min_replicas}) must be <= max_replicas "
                f"({self.serving_config.max_replicas})")

    def _check_cudagraph_sizes(self) -> None:
        compilation = self.compilation_config
        sizes, largest = compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size
        if sizes is None:
            return
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cudagraph_capture_sizes: {sizes}; give positive batch sizes")
        if largest is not None and largest != max(sizes):
            raise ValueError(f"max_cudagraph_capture_size ({largest}) must equal the largest of "
                             f"cudagraph_capture_sizes ({max(sizes)}) when both are given")
