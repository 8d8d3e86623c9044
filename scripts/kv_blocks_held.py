"""Blocks (and bytes) of KV one long request holds, from raylm's KV cache manager: the request is prefilled in chunks
and decoded as the scheduler would, once with the model's window freeing blocks and once keeping every block.

    python scripts/kv_blocks_held.py                          # Mistral-7B-v0.1's shape (transformers' MistralConfig)
    python scripts/kv_blocks_held.py --config path/to/config.json --prompt-tokens 16384
"""
from __future__ import annotations

import argparse

from transformers import AutoConfig, MistralConfig, PretrainedConfig

from raylm.cluster.core.kv_cache_manager import KVCacheManager, freeing_window
from raylm.cluster.core.request import Request
from raylm.common.sampling_params import SamplingParams


def most_blocks_held(window: int | None, prompt_tokens: int, decode_tokens: int, chunk: int,
                     block_size: int) -> tuple[int, int]:
    """The most blocks the request holds after a prefill step and after a decode step (a pool big enough for all of
    it, no prefix caching)."""
    kv = KVCacheManager(-(-(prompt_tokens + decode_tokens) // block_size), block_size, False, window)
    request = Request("long", [i % 1000 for i in range(prompt_tokens)], SamplingParams(max_tokens=decode_tokens))
    most = [0, 0]  # prefill, decode
    while request.num_output_tokens < decode_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        decoding = request.num_output_tokens > 0
        most[decoding] = max(most[decoding], kv.num_held_blocks("long"))
        if request.num_computed_tokens == request.num_tokens:  # the step sampled a token
            request.append_output_token_id(7)
    return most[0], most[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a config.json or checkpoint folder (default: MistralConfig())")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per step (max_num_batched_tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args()
    config: PretrainedConfig = MistralConfig() if args.config is None else AutoConfig.from_pretrained(args.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = (2 * args.block_size * config.num_key_value_heads * head_dim * args.dtype_bytes
                   * config.num_hidden_layers)  # K and V, every layer
    window = freeing_window([config])
    print(f"{type(config).__name__}: {config.num_hidden_layers} layers, window {window or 'none (a global layer)'}, "
          f"{block_bytes / 2**20:.2f} MiB per block of {args.block_size} tokens; "
          f"{args.prompt_tokens} prompt + {args.decode_tokens} generated tokens, prefilled {args.chunk} a step")
    for name, freeing in (("freeing past the window", window), ("every block kept", None)):
        prefill, decode = most_blocks_held(freeing, args.prompt_tokens, args.decode_tokens, args.chunk, args.block_size)
        print(f"  {name}: at most {prefill} blocks held while prefilling ({prefill * block_bytes / 2**30:.2f} GiB), "
              f"{decode} while decoding ({decode * block_bytes / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
