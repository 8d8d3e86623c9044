"""EngineCore: the scheduler and the executor, one step at a time.

A step schedules, starts the forward (execute_model), then samples (sample_tokens) and feeds the
sampled tokens back to the scheduler. Requests arrive already tokenized.
"""
from __future__ import annotations

import random
from dataclasses import replace

from cluster.outputs import EngineCoreOutput
from cluster.request import Request, RequestStatus
from cluster.scheduler import Scheduler
from configs import EngineConfig
from configs.model_info import ModelInfo
from executor import Executor


class EngineCore:
    def __init__(self, config: EngineConfig, model_info: ModelInfo) -> None:
        self.config = config
        self.model_info = model_info
        self.executor = Executor.get_class(config)(config, model_info)
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, model_info.max_model_len, self.num_blocks,
            config.cache_config.block_size,
            send_token_ids=config.parallel_config.pipeline_parallel_size > 1)
        # Requests without a seed get one drawn here, so every rank samples them identically.
        self._seed_rng = random.Random(config.model_config.seed)

    def add_request(self, request: Request) -> None:
        if request.sampling_params.seed is None:
            request.sampling_params = replace(request.sampling_params, seed=self._seed_rng.getrandbits(62))
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        output = self.executor.execute_model(scheduler_output).result()
        if output is None:
            output = self.executor.sample_tokens().result()
        assert output is not None, "the output rank returned no ModelRunnerOutput"
        return self.scheduler.update_from_output(scheduler_output, output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
