"""Blocks (and bytes) of KV one long request holds, from raylm's KV cache manager: the request is prefilled in chunks
and decoded as the scheduler would, once with the model's windows freeing blocks and once keeping every block (what an
all-global model of the same shape holds). Where every layer slides (Mistral) the request's blocks are freed past the
window; where sliding and global layers mix (Gemma 2 / 3, GPT-OSS) the sliding layers' own group is
(configs/kv_cache_groups.py), and the global layers keep every block.

    python scripts/kv_blocks_held.py                          # Mistral-7B-v0.1's shape (transformers' MistralConfig)
    python scripts/kv_blocks_held.py --model gemma-3-1b --prompt-tokens 4096
    python scripts/kv_blocks_held.py --config path/to/config.json --prompt-tokens 16384
"""
from __future__ import annotations

import argparse

from transformers import AutoConfig, Gemma3TextConfig, MistralConfig, PretrainedConfig

from raylm.cluster.core.kv_cache_manager import KVCacheManager
from raylm.cluster.core.request import Request
from raylm.cluster.core.sliding_window_group import SlidingWindowGroup
from raylm.common.sampling_params import SamplingParams
from raylm.configs.attention_backends import layer_sliding_windows

# Shapes by name, from the checkpoints' config.json (no download).
SHAPES = {
    "mistral-7b-v0.1": MistralConfig,
    "gemma-3-1b": lambda: Gemma3TextConfig(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768),
}


def most_layer_blocks_held(windows: list[int | None], freeing: bool, prompt_tokens: int, decode_tokens: int,
                           chunk: int, block_size: int) -> tuple[int, int]:
    """The most layer-blocks (a block of one layer) the request holds after a prefill step and after a decode step (a
    pool big enough for all of it, no prefix caching)."""
    sliding = [window for window in windows if window is not None]
    num_global = len(windows) - len(sliding)
    pool = -(-(prompt_tokens + decode_tokens) // block_size)
    group = (SlidingWindowGroup(pool, block_size, max(sliding), False) if freeing and sliding and num_global
             else None)
    kv = KVCacheManager(pool, block_size, False, max(sliding) if freeing and sliding and not num_global else None,
                        group)
    request = Request("long", [i % 1000 for i in range(prompt_tokens)], SamplingParams(max_tokens=decode_tokens))
    most = [0, 0]  # prefill, decode
    while request.num_output_tokens < decode_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        held = (kv.num_held_blocks("long") * len(windows) if group is None
                else kv.num_held_blocks("long") * num_global + group.num_held_blocks("long") * len(sliding))
        decoding = request.num_output_tokens > 0
        most[decoding] = max(most[decoding], held)
        if request.num_computed_tokens == request.num_tokens:  # the step sampled a token
            request.append_output_token_id(7)
    return most[0], most[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="mistral-7b-v0.1", help="a known shape")
    parser.add_argument("--config", help="a config.json or checkpoint folder (instead of --model)")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per step (max_num_batched_tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args()
    config: PretrainedConfig = SHAPES[args.model]() if args.config is None else AutoConfig.from_pretrained(args.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_block_bytes = 2 * args.block_size * config.num_key_value_heads * head_dim * args.dtype_bytes  # K and V
    windows = layer_sliding_windows(config)
    num_sliding = sum(window is not None for window in windows)
    print(f"{type(config).__name__}: {len(windows)} layers ({num_sliding} sliding, window "
          f"{max((w for w in windows if w is not None), default='none')}), "
          f"{layer_block_bytes * len(windows) / 2**20:.2f} MiB per block of {args.block_size} tokens of every layer; "
          f"{args.prompt_tokens} prompt + {args.decode_tokens} generated tokens, prefilled {args.chunk} a step")
    for name, freeing in (("freeing past the window", True), ("every block kept (all-global)", False)):
        prefill, decode = most_layer_blocks_held(windows, freeing, args.prompt_tokens, args.decode_tokens, args.chunk,
                                                 args.block_size)
        # In blocks of every layer, so that both rows count the same unit.
        print(f"  {name}: at most {prefill / len(windows):.0f} blocks held while prefilling "
              f"({prefill * layer_block_bytes / 2**30:.3f} GiB), {decode / len(windows):.0f} while decoding "
              f"({decode * layer_block_bytes / 2**30:.3f} GiB)")


if __name__ == "__main__":
    main()
