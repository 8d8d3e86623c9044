"""`build_processor(config, preprocess, postprocess)`: a callable from a Ray Dataset of rows to a Dataset of results,
through a pool of engine replicas (ray.data.llm's shape). `preprocess` makes each row's `prompt` or `messages` and
`sampling_params`; `postprocess` shapes each result row. With should_continue_on_error, a failed row skips
`postprocess` and comes out as it went in, with `__inference_error__` saying why."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import ray.data

from raylm.cluster.batch.engine_stage import EngineStageUDF
from raylm.cluster.batch.processor_config import EngineProcessorConfig
from raylm.cluster.batch.replica_resources import replica_remote_args
from raylm.cluster.batch.rows import ERROR_COLUMN
from raylm.configs import EngineConfig

Row = dict[str, Any]
RowFn = Callable[[Row], Row]


class Processor:
    def __init__(self, config: EngineProcessorConfig, preprocess: RowFn | None = None,
                 postprocess: RowFn | None = None) -> None:
        self.config = config
        self.engine_config = config.engine_config()  # bad settings fail at build time
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        """Lazy, as every Dataset transform: the replicas start when the result is consumed (written, iterated)."""
        config = self.config
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess)
        dataset = map_through_replicas(dataset, EngineStageUDF, {
            "engine_config": self.engine_config, "apply_chat_template": config.apply_chat_template,
            "should_continue_on_error": config.should_continue_on_error}, config, self.engine_config)
        if self.postprocess is not None:
            dataset = dataset.map(_skipping_failed_rows(self.postprocess) if config.should_continue_on_error
                                  else self.postprocess)
        return dataset


def map_through_replicas(dataset: ray.data.Dataset, udf: type, constructor_kwargs: dict[str, Any],
                         config: EngineProcessorConfig, engine_config: EngineConfig) -> ray.data.Dataset:
    """`dataset` through a pool of replicas of `udf` (an actor class running one engine each), in batches of
    config.batch_size, up to config.max_concurrent_batches of them in each replica at once."""
    if not ray.is_initialized():
        ray.init()  # the replicas' resources are read from the cluster
    min_size, max_size = config.pool_sizes()
    remote_args = replica_remote_args(engine_config, config.placement_group_config)
    if config.runtime_env:
        remote_args["runtime_env"] = config.runtime_env
    return dataset.map_batches(
        udf,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=config.batch_size,
        batch_format="pyarrow",
        zero_copy_batch=True,
        # Ray Data queues 2 x max_concurrency tasks per replica (ray.data.llm's default too): a pool grows only once
        # its replicas' queues pass 1.75 x max_concurrency, so capping them at max_concurrency kept it at min_size.
        compute=ray.data.ActorPoolStrategy(min_size=min_size, max_size=max_size),
        max_concurrency=config.max_concurrent_batches,  # the replica runs them all at once (an async UDF)
        **remote_args,
    )


def build_processor(config: EngineProcessorConfig, preprocess: RowFn | None = None,
                    postprocess: RowFn | None = None) -> Processor:
    return Processor(config, preprocess, postprocess)


def _skipping_failed_rows(postprocess: RowFn) -> RowFn:
    def apply(row: Row) -> Row:
        if row.get(ERROR_COLUMN):
            return row
        return postprocess(row) | {ERROR_COLUMN: ""}

    return apply
