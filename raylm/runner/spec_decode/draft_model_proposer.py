"""Draft-model drafts: a second, smaller checkpoint with the target's vocabulary, run by the same worker (sharded by
the same TP group), with KV cache of its own in the target's blocks (same block ids and block table, so a prefix-cache
hit brings the draft's KV along).

After each target step it first catches up: one forward over every position the target computed this step that now
holds an accepted token, plus each sampling request's new last token (which no model has seen yet); the logits of
that last token give draft 1. Then k - 1 one-token forwards give drafts 2..k. Their KV slots lie past the step's
tokens: the scheduler allocates k lookahead slots per request for them. Greedy requests draft the argmax; random ones
sample from the draft's distribution q (the request's temperature, top-k, top-p, min-p), which the rejection sampler
needs, with noise salted apart from the target's.
"""
from __future__ import annotations

import numpy as np
import torch

from raylm.common.object_storage import checkpoint_here
from raylm.common.sampling_params import _GREEDY_EPS
from raylm.configs import EngineConfig
from raylm.configs.model_info import ModelInfo
from raylm.configs.quant_formats import read_checkpoint_quant
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.forward_context import set_forward_context
from raylm.runner.input_batch import InputBatch
from raylm.runner.input_buffers import InputBuffers
from raylm.runner.layers.attention import Attention
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.models.loader import load_model
from raylm.runner.sampler import apply_top_k_top_p_min_p, argmax_rows, gumbel_max_sample
from raylm.runner.sampling_metadata import SamplingMetadata
from raylm.runner.spec_decode.proposer import Proposals, ProposeInputs, Proposer
from raylm.runner.spec_decode.spec_sampling import DRAFT_SALT


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, draft: ModelInfo, attn_backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None
        # The draft's layers shard over the target's TP group: resolution allows no other draft_tensor_parallel_size.
        assert spec.draft_tensor_parallel_size == config.parallel_config.tensor_parallel_size
        self.k = spec.num_speculative_tokens
        self.draft, self.attn_backend, self.dtype, self.device = draft, attn_backend, dtype, device
        block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        assert max_model_len is not None
        self.max_model_len = max_model_len
        max_num_reqs = config.scheduler_config.max_num_seqs
        # A catch-up covers the step's tokens less the rejected drafts, plus each request's new last token.
        self.buffers = InputBuffers(config.scheduler_config.max_num_batched_tokens + max_num_reqs, max_num_reqs,
                                    -(-max_model_len // block_size), block_size, device)
        self.model: LlamaForCausalLM | None = None

    def load_model(self, target_model: torch.nn.Module) -> None:
        assert self.draft.hf_config is not None
        path = checkpoint_here(self.draft.path, self.draft.source, "speculative_config.model")
        quant = read_checkpoint_quant(self.draft.hf_config)  # a draft quantized as shipped loads by its own format
        self.model = load_model(path, self.draft.hf_config, dtype=self.dtype, device=self.device,
                                quantization="none" if quant is None else quant.method)

    def attention_layers(self) -> list[Attention]:
        assert self.model is not None, "load_model first"
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> Proposals:
        batch, rows, metadata = inputs.batch, inputs.sampling_rows, inputs.sampling_metadata
        all_rows = np.arange(batch.num_reqs)
        # Positions below `allocated` have KV slots: the step's tokens and the lookahead the scheduler gave, which
        # ends at the request's last possible token (where a request that reaches it is finished: nothing to draft).
        allocated = batch.block_table.num_blocks[:batch.num_reqs].astype(np.int64) * self.buffers.block_size
        samples = np.zeros(batch.num_reqs, dtype=np.int64)
        samples[rows] = 1
        starts = inputs.step_start.astype(np.int64)
        ends = np.minimum(inputs.step_end.astype(np.int64) + samples, allocated)  # a sampling row's new last token
        query_lens = ends - starts
        offsets = np.arange(int(query_lens.sum())) - np.repeat(query_lens.cumsum() - query_lens, query_lens)
        positions = np.repeat(starts, query_lens) + offsets
        logits = self._forward(batch, all_rows, query_lens, positions, None, (query_lens.cumsum() - 1)[rows])

        num_tokens = batch.num_tokens[rows].astype(np.int64)
        output_positions = num_tokens - batch.num_prompt_tokens[rows]
        allocated = allocated[rows]
        # Draft i + 1 is read from draft i at position num_tokens - 1 + i, which must have a slot.
        max_drafts = np.clip(np.minimum(inputs.max_num_drafts, self.k), 0, allocated - num_tokens + 1)
        ones = np.ones(len(rows), dtype=np.int64)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(int(max_drafts.max()) if len(rows) else 0):
            if i > 0:  # rows past their drafts rerun a position they hold, writing nothing, and are dropped
                active = i < max_drafts
                positions = np.where(active, num_tokens - 1 + i, np.minimum(num_tokens, allocated) - 1)
                logits = self._forward(batch, rows, ones, positions, tokens[-1].cpu().numpy(), np.arange(len(rows)),
                                       writes=active)
            token, q = _sample_drafts(logits, metadata, output_positions + i)
            tokens.append(token)
            probs.append(q)
        if not tokens:
            return Proposals([[] for _ in rows])
        token_ids = torch.stack(tokens, dim=1).tolist()
        counts = max_drafts.tolist()
        drafts = [row_tokens[:n] for row_tokens, n in zip(token_ids, counts)]
        if metadata.all_greedy:
            return Proposals(drafts)
        greedy = (metadata.temperature < _GREEDY_EPS).tolist()
        stacked = torch.stack(probs, dim=1)  # [rows, steps, vocab]
        return Proposals(drafts, [None if g else stacked[j, :n] for j, (g, n) in enumerate(zip(greedy, counts))])

    def _forward(self, batch: InputBatch, rows: np.ndarray, query_lens: np.ndarray, positions: np.ndarray,
                 input_ids: np.ndarray | None, logits_index: np.ndarray, writes: np.ndarray | None = None
                 ) -> torch.Tensor:
        """One draft forward: batch row rows[i] queries query_lens[i] tokens at `positions` (grouped by row), their ids
        `input_ids` (None: the batch's tokens there); writes[i] False: row i writes no KV. Returns the logits of the
        packed tokens at `logits_index`."""
        assert self.model is not None, "load_model first"
        buffers, n = self.buffers, len(positions)
        req_index = np.repeat(rows, query_lens)
        buffers.input_ids.np[:n] = batch.token_ids_cpu[req_index, positions] if input_ids is None else input_ids
        buffers.positions.np[:n] = positions
        block_numbers = batch.block_table.table[req_index, positions // buffers.block_size].astype(np.int64)
        slots = block_numbers * buffers.block_size + positions % buffers.block_size
        buffers.slot_mapping.np[:n] = slots if writes is None else np.where(np.repeat(writes, query_lens), slots, -1)
        num_reqs = len(rows)
        cu = query_lens.cumsum()
        buffers.query_start_loc.np[0] = 0
        buffers.query_start_loc.np[1 : num_reqs + 1] = cu
        seq_lens = positions[cu - 1] + 1
        buffers.seq_lens.np[:num_reqs] = seq_lens
        max_blocks = int(batch.block_table.num_blocks[rows].max())
        buffers.block_table[:num_reqs, :max_blocks].copy_(
            torch.from_numpy(batch.block_table.table[rows, :max_blocks]), non_blocking=True)
        common = buffers.common_metadata(num_reqs, n, max_blocks, int(query_lens.max()), int(seq_lens.max()))
        with set_forward_context(self.attn_backend.build(common), n):
            hidden = self.model(buffers.input_ids.gpu[:n], buffers.positions.gpu[:n], None)
        index = torch.from_numpy(logits_index).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[index]).float()


def _sample_drafts(logits: torch.Tensor, metadata: SamplingMetadata, output_positions: np.ndarray
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampling row: the draft token (argmax for greedy rows, else drawn from q with the draft's own noise) and q
    (the greedy rows' q is never read)."""
    tokens = argmax_rows(logits).to(logits.device)
    if metadata.all_greedy:
        return tokens, logits
    random_rows = torch.nonzero(metadata.temperature >= _GREEDY_EPS).squeeze(1)
    scaled = logits[random_rows] / metadata.temperature[random_rows][:, None]

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[random_rows]

    apply_top_k_top_p_min_p(scaled, take(metadata.top_k), take(metadata.top_p), take(metadata.min_p))
    q = scaled.softmax(dim=-1)
    positions = torch.from_numpy(output_positions).to(logits.device)[random_rows]
    sampled = gumbel_max_sample(scaled, metadata.seeds[random_rows] ^ DRAFT_SALT, positions)
    probs = logits.new_full(logits.shape, float("nan"))
    probs[random_rows] = q
    return tokens.index_copy_(0, random_rows, sampled.to(tokens.dtype)), probs
