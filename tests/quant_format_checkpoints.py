"""Tiny quantized checkpoints written by the formats' own tools on CPU, for tests/test_quant_formats*.py.

compressed-tensors: its `apply_quantization_config` attaches the scheme, its `calculate_qparams` gives each weight's
scales and zero points from the weight's min / max (round to nearest, as llmcompressor's QuantizationModifier does
without calibration data), and its ModelCompressor packs and writes the folder with the `quantization_config`."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# name -> (compressed-tensors format, weight args, input activation args or None)
CT_SCHEMES: dict[str, tuple[str, dict, dict | None]] = {
    "w4a16-group-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                group_size=64), None),
    "w4a16-group-sym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=32), None),
    "w4a16-channel-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="channel"), None),
    "w8a16-channel-sym": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None),
    "w8a8-int": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                 dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)),
}


def write_compressed_tensors(src: Path, scheme_name: str, out: Path, group_size: int | None = None) -> Path:
    """`src` (a float checkpoint) quantized by compressed-tensors with CT_SCHEMES[scheme_name] (its group size
    replaced by `group_size` if given), LM head left float."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    fmt, weights, activations = CT_SCHEMES[scheme_name]
    if group_size is not None:
        weights = {**weights, "group_size": group_size}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        format=fmt))
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.detach()
        if args.strategy == "group":
            weight = weight.reshape(weight.shape[0], -1, args.group_size)
        elif args.strategy == "channel":
            weight = weight.unsqueeze(1)
        else:
            weight = weight.reshape(1, 1, -1)
        scale, zero_point = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    return out


def write_gptq(src: Path, out: Path, desc_act: bool, sym: bool, group_size: int = 32) -> Path:
    """`src` quantized by GPTQModel (GPTQ with its Hessians from a few random calibration sequences, on CPU)."""
    import os

    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its CPU pool wants 2 workers; the default here gives 1
    from gptqmodel import GPTQModel, QuantizeConfig

    generator = torch.Generator().manual_seed(0)
    calibration = [{"input_ids": torch.randint(0, 512, (1, 32), generator=generator),
                    "attention_mask": torch.ones(1, 32, dtype=torch.long)} for _ in range(8)]
    model = GPTQModel.load(str(src), QuantizeConfig(bits=4, group_size=group_size, desc_act=desc_act, sym=sym),
                           device="cpu")
    cwd = os.getcwd()
    os.chdir(out.parent)  # GPTQModel writes its timing logs under ./logs: not in the checkout
    try:
        model.quantize(calibration, batch_size=1)
    finally:
        os.chdir(cwd)
    model.save(str(out))
    return out


def greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int
           ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """tests/reference.hf_greedy on a model already loaded (with a quantization config of its own)."""
    from tests.reference import model_greedy

    return model_greedy(model, prompts, max_tokens)


def _awq_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"}


def write_awq(src: Path, out: Path, group_size: int = 32) -> Path:
    """`src` in AWQ's GEMM layout, packed by GPTQModel's AWQ packer (AwqTorchLinear.pack) from round-to-nearest
    asymmetric group scales: GPTQModel's AWQ search (which also rescales the float weights) needs CUDA; the packed
    layout, which is what raylm reads, is the same."""
    import json

    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # the LM head is the embedding (SmolLM2): saved once, as transformers does
        del state["lm_head.weight"]
    for name, linear in _awq_linears(model).items():
        weight = linear.weight.data
        groups = weight.reshape(weight.shape[0], -1, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).half().float()
        zeros = torch.round(-low / scales).clamp(0, 15)
        q = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, 15)
        linear.weight.data = ((q - zeros[..., None]) * scales[..., None]).reshape(weight.shape)
        packer = AwqTorchLinear(bits=4, group_size=group_size, sym=False, desc_act=False,
                                in_features=linear.in_features, out_features=linear.out_features, bias=False)
        packer.pack(linear, scales.half(), zeros)
        del state[f"{name}.weight"]
        state.update({f"{name}.qweight": packer.qweight, f"{name}.qzeros": packer.qzeros,
                      f"{name}.scales": packer.scales})
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                     "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    return out

