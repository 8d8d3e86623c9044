"""Batch inference on Ray Data, in the shape of `ray.data.llm`:

    from raylm.data import EngineProcessorConfig, build_processor
    processor = build_processor(EngineProcessorConfig(model_source=PATH, concurrency=2),
                                preprocess=lambda row: {"prompt": row["text"], "sampling_params": {"max_tokens": 64}})
    processor(ray.data.read_parquet(...)).write_parquet(...)

(docs/batch.md; the code is raylm/cluster/batch/.)
"""
from raylm.cluster.batch.processor import Processor, build_processor
from raylm.cluster.batch.processor_config import EngineProcessorConfig

__all__ = ["EngineProcessorConfig", "Processor", "build_processor"]
