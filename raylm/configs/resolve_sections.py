"""The sections resolution fills in beside its decisions (configs/resolve.py): speculative decoding's defaults, the
KV connector, routing and the grammar backends, each refused with the reason where raylm cannot run it. Pure: the
checkpoints' facts and the installed packages come in as arguments."""
from __future__ import annotations

from raylm.configs.engine_config import EngineConfig, SpeculativeConfig
from raylm.configs.environment import EnvironmentFacts
from raylm.configs.kv_transfer import KVTransferConfig
from raylm.configs.model_info import ModelInfo
from raylm.configs.parallel_checks import check_draft_tensor_parallel
from raylm.configs.quant_formats import read_checkpoint_quant
from raylm.configs.structured_outputs_config import StructuredOutputsConfig


def resolve_speculative(config: EngineConfig, model_info: ModelInfo, draft: ModelInfo | None, max_model_len: int,
                        dp_lockstep: bool, quantization: str, env: EnvironmentFacts) -> SpeculativeConfig | None:
    """speculative_config with vLLM's defaults filled in (ngram: prompt_lookup_min/max 5, or each the other's; draft
    TP: the target's), and the draft checkpoint's facts; combinations raylm cannot run are refused, naming why."""
    spec = config.speculative_config
    if spec is None:
        return None
    parallel, k = config.parallel_config, spec.num_speculative_tokens
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative_config: not supported with pipeline_parallel_size > 1: drafts are verified on "
                         "the last stage, and the first stage would need them before the step's output comes back")
    if uniform_decode_query_len(spec) > config.scheduler_config.max_num_batched_tokens:
        raise ValueError(f"speculative_config.num_speculative_tokens ({k}) + 1 must be <= max_num_batched_tokens "
                         f"({config.scheduler_config.max_num_batched_tokens}): a decode step verifies k drafts at once")
    if spec.method == "ngram":
        for name in ("model", "draft_tensor_parallel_size"):
            if getattr(spec, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method 'draft_model'; method 'ngram' takes none")
        lookup_max = spec.prompt_lookup_max or spec.prompt_lookup_min or 5
        lookup_min = spec.prompt_lookup_min or lookup_max
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max "
                             f"({lookup_max})")
        return spec.model_copy(update={"prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max})

    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if getattr(spec, name) is not None:
            raise ValueError(f"speculative_config.{name} is for method 'ngram'; method 'draft_model' takes none")
    if spec.model is None:
        raise ValueError("speculative_config.model: method 'draft_model' needs the draft checkpoint's folder")
    tp = parallel.tensor_parallel_size
    if spec.draft_tensor_parallel_size not in (None, tp):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size ({spec.draft_tensor_parallel_size}) must "
                         f"equal tensor_parallel_size ({tp}): the draft runs on the target's workers, sharded alike")
    if dp_lockstep:
        raise ValueError("speculative_config: method 'draft_model' is not supported with expert-parallel data "
                         "parallel (lock-step DP): the draft's forwards would need their own DP coordination")
    assert draft is not None, "the engine reads the draft checkpoint's facts before resolving"
    check_architecture(draft.architecture, env)
    if draft.vocab_size != model_info.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size ({draft.vocab_size}) differs from the "
                         f"target's ({model_info.vocab_size}); draft and target must share one vocabulary")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len ({max_model_len})")
    check_draft_tensor_parallel(draft, model_info, tp, quantization, parallel.enable_expert_parallel)
    check_draft_quantization(draft, tp)
    return spec.model_copy(update={"draft_tensor_parallel_size": tp})


def uniform_decode_query_len(spec: SpeculativeConfig | None) -> int:
    """Query rows per request in a decode step (vLLM's uniform_decode_query_len): the sampled token, and with
    speculative decoding its k drafts to verify."""
    return 1 if spec is None else 1 + spec.num_speculative_tokens


def check_draft_quantization(draft: ModelInfo, tp: int) -> None:
    """A draft quantized as shipped (compressed-tensors, GPTQ, AWQ) loads by its own format; one raylm cannot run is
    refused here, before loading, and so is TP > 1 for one (its sharding is not tested)."""
    try:
        quant = read_checkpoint_quant(draft.hf_config)
    except ValueError as error:
        raise ValueError(f"speculative_config.model: the draft's {error}") from None
    if quant is not None and tp > 1:
        raise ValueError(f"speculative_config.model: a draft quantized as shipped ({quant.describe()}) runs at "
                         f"tensor_parallel_size 1 only, not {tp}; use a float draft")


def resolve_routing_policy(config: EngineConfig) -> str:
    """"load" or "prefix" (over DP engines and Serve replicas); auto: prefix where prefix caching is on."""
    policy = config.routing_config.routing_policy
    caching = config.cache_config.enable_prefix_caching
    if policy == "auto":
        return "prefix" if caching else "load"
    if policy == "prefix" and not caching:
        raise ValueError("routing_policy 'prefix' routes to the engine holding a prompt's cached prefix: it needs "
                         "enable_prefix_caching")
    return policy


# structured_outputs_backend -> the backends a constraint is tried against, in order, and the package each needs.
_GRAMMAR_BACKENDS = {"auto": ("xgrammar", "guidance"), "xgrammar": ("xgrammar",), "guidance": ("guidance",)}
GRAMMAR_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def structured_outputs_backends(config: StructuredOutputsConfig, env: EnvironmentFacts) -> tuple[str, ...]:
    """The grammar backends of constrained requests, in the order each constraint tries them. `auto` is vLLM's:
    xgrammar, then guidance (llguidance) for what xgrammar cannot enforce; the choice among them is made per
    constraint (structured_output/validation.py), the list here, once."""
    backends = _GRAMMAR_BACKENDS[config.structured_outputs_backend]
    for name in backends:
        if GRAMMAR_PACKAGES[name] not in env.installed_packages:
            raise ValueError(f"structured_outputs_backend {config.structured_outputs_backend!r} needs the "
                             f"{GRAMMAR_PACKAGES[name]} package, which is not installed")
    return backends


def check_architecture(architecture: str, env: EnvironmentFacts) -> None:
    """Raise, naming the supported ones, unless raylm has a model for `architecture` (config.json's first)."""
    if architecture not in env.architectures:
        raise ValueError(f"model: unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(env.architectures)}")


def resolve_kv_transfer(config: EngineConfig) -> KVTransferConfig:
    """kv_offloading_size alone turns the OffloadingConnector on (as in vLLM); a connector runs on engines of one
    device each (data parallel is fine) and not with micro-batched forwards."""
    kv = config.kv_transfer_config
    if kv.kv_connector is None and kv.kv_offloading_size is not None:
        kv = kv.model_copy(update={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    if kv.kv_connector is None:
        return kv
    parallel = config.parallel_config
    if parallel.world_size != 1:
        raise ValueError(f"kv_connector {kv.kv_connector}: raylm's KV connectors run on engines of one device "
                         f"(tensor_parallel_size x pipeline_parallel_size is {parallel.world_size}); use "
                         f"data_parallel_size for more engines")
    if parallel.enable_dbo:
        raise ValueError(f"kv_connector {kv.kv_connector}: not with enable_dbo (a layer's KV is saved once per "
                         f"forward, not per micro-batch)")
    if kv.kv_connector == "OffloadingConnector":
        if kv.kv_offloading_size is None:
            raise ValueError("kv_offloading_size: the OffloadingConnector needs the host memory to use (GiB)")
        if not config.cache_config.enable_prefix_caching:
            raise ValueError("kv_connector OffloadingConnector keeps evicted prefix-cache blocks: it needs "
                             "enable_prefix_caching")
    return kv
