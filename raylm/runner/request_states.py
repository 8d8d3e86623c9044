"""The runner's copy of each unfinished request (CachedRequestState), kept in step with the scheduler: each
SchedulerOutput's finished, new and cached requests are applied to the states and to the InputBatch, whose rows are
the requests scheduled this step."""
from __future__ import annotations

from raylm.common.outputs import SchedulerOutput
from raylm.runner.input_batch import CachedRequestState, InputBatch
from raylm.runner.prompt_logprobs import PromptLogprobsProcessor
from raylm.runner.spec_decode.spec_decoder import SpecDecoder


class RequestStates:
    def __init__(self, input_batch: InputBatch, prompt_logprobs: PromptLogprobsProcessor,
                 spec_decoder: SpecDecoder | None) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch, self.prompt_logprobs, self.spec_decoder = input_batch, prompt_logprobs, spec_decoder

    def update(self, scheduler_output: SchedulerOutput, samples_here: bool) -> None:
        """Apply a step's SchedulerOutput before its inputs are prepared. `samples_here`: this rank sampled the
        previous steps' tokens itself (the last pipeline stage); other ranks are sent them."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.remove_request(req_id)
            if self.spec_decoder is not None:
                self.spec_decoder.remove_request(req_id)
            batch.remove_request(req_id)
        # Requests not scheduled this step leave the batch but keep their state (the order of removals does not
        # matter: holes are refilled lowest first).
        for req_id in batch.req_id_to_index.keys() - scheduler_output.num_scheduled_tokens.keys():
            batch.remove_request(req_id)

        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
                                       new.sampling_params, list(new.block_ids), new.num_computed_tokens,
                                       new.lora_request, list(new.sliding_block_ids))
            self.requests[new.req_id] = state
            batch.add_request(state)
            self.prompt_logprobs.add_request(new)

        cached = scheduler_output.scheduled_cached_reqs
        requests, req_id_to_index = self.requests, batch.req_id_to_index
        receives_tokens = any(cached.new_token_ids) and not samples_here
        # Rows already in the batch get their computed-token counts in one numpy write.
        rows: list[int] = []
        rows_num_computed: list[int] = []
        for i, (req_id, new_block_ids, num_computed) in enumerate(
                zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)):
            state = requests[req_id]
            if self.spec_decoder is not None:  # async scheduling counted every draft in flight as accepted
                num_computed = self.spec_decoder.correct_num_computed(req_id, num_computed)
            state.num_computed_tokens = num_computed
            row = req_id_to_index.get(req_id)
            new_sliding_ids = cached.new_sliding_block_ids[i] if cached.new_sliding_block_ids else []
            if row is None:
                state.block_ids.extend(new_block_ids)
                state.sliding_block_ids.extend(new_sliding_ids)
                row = batch.add_request(state)
            else:
                if new_block_ids:  # most decode steps need no new block
                    state.block_ids.extend(new_block_ids)
                    batch.block_table.append_row(row, new_block_ids)
                if new_sliding_ids:
                    state.sliding_block_ids.extend(new_sliding_ids)
                    assert batch.sliding_block_table is not None, "sliding ids come only with a sliding group"
                    batch.sliding_block_table.append_row(row, new_sliding_ids)
                rows.append(row)
                rows_num_computed.append(num_computed)
            # Only ranks that did not sample these tokens themselves (PP > 1) are sent them.
            if receives_tokens:
                for token in cached.new_token_ids[i]:
                    batch.append_token(row, token)
                    state.output_token_ids.append(token)
        if rows:
            batch.num_computed_tokens_cpu[rows] = rows_num_computed
        batch.condense()
