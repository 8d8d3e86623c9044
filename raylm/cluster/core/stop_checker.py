"""When a request stops, judged on token ids after each sampled token (stop strings are found later, on the
detokenized text, by the OutputProcessor)."""
from __future__ import annotations

from raylm.cluster.core.request import Request, RequestStatus


def check_stop(request: Request) -> bool:
    """Sets the finished status if the last output token ends the request. Stop tokens (EOS included) count only
    after min_tokens outputs; the length cap always does."""
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens > params.min_tokens:
        token_id = output_token_ids[-1]
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
