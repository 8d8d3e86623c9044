"""POST /v1/embeddings: one embedding per input (a string or token ids), each a pooling request on the engine that
serves the completions too (AsyncLLM.encode), answered together."""
from __future__ import annotations

import asyncio
import base64
import logging
from typing import cast

import torch

from raylm.cluster.engine.pooling_checks import check_dimensions
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from raylm.cluster.entrypoints.openai.serving_engine import OpenAIServing, random_id, usage
from raylm.common.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        await self.engine.wait_until_ready()
        if request.model_extra:  # ignored, and said so, as for the other endpoints
            logger.warning("the request's fields %s are not known here: ignored", sorted(request.model_extra))
        inputs = [self._checked_input(ids) for ids in self._tokenize(request)]
        if request.dimensions is not None:
            try:
                check_dimensions(request.dimensions, self.engine.engine_config)
            except ValueError as err:
                raise OpenAIError(str(err), param="dimensions") from None
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        request_id = random_id("embd")
        outputs = await asyncio.gather(*[
            self.engine.encode(f"{request_id}-{i}", {"prompt_token_ids": ids}, params, request.priority or 0)
            for i, ids in enumerate(inputs)])
        data = [EmbeddingData(index=i, embedding=_encode(output.outputs.data, request.encoding_format))
                for i, output in enumerate(outputs)]
        num_prompt_tokens = sum(len(ids) for ids in inputs)
        return EmbeddingResponse(id=request_id, model=self.model_name, data=data, usage=usage(num_prompt_tokens, 0))

    def _tokenize(self, request: EmbeddingRequest) -> list[list[int]]:
        given = request.input
        one = isinstance(given, str) or isinstance(given[0], int)  # a string or one list of token ids
        inputs = cast(list[str | list[int]], [given] if one else given)
        tokenizer = self.engine.tokenizer
        return [tokenizer.encode(text, add_special_tokens=request.add_special_tokens) if isinstance(text, str)
                else list(text) for text in inputs]

    def _checked_input(self, token_ids: list[int]) -> list[int]:
        """Refused here with a status, as vLLM's server does; an embedding input may fill max_model_len (nothing is
        generated after it)."""
        config = self.engine.engine_config
        max_model_len, vocab_size = config.model_config.max_model_len, config.model_info.vocab_size
        assert max_model_len is not None, "the engine's config is resolved: max_model_len is set"
        if not token_ids:
            raise OpenAIError("input: it is empty (0 tokens)", param="input")
        if len(token_ids) > max_model_len:
            raise OpenAIError(  # vLLM's words
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length of the "
                f"input.", param="input")
        outside = [t for t in token_ids if not 0 <= t < vocab_size]
        if outside:
            raise OpenAIError(f"input: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})",
                              param="input")
        return token_ids


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    values = vector.numpy().astype("<f4")
    if encoding_format == "base64":  # what OpenAI's client decodes with np.frombuffer(..., dtype="float32")
        return base64.b64encode(values.tobytes()).decode()
    return cast(list[float], values.tolist())
