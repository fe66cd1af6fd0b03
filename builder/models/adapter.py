"""A feature's adapter: a low-rank update (LoRA) of the frozen base's projections, read and written as PEFT does.

The production model of a feature is the frozen base plus its adapter: every projection W of every layer
(`llama.PROJECTIONS`) computes x W^T + scale * (x A^T) B^T, with A (rank, in) and B (out, rank) the adapter's
and scale = alpha / rank. The base's weights, and so its fingerprint, never change; an adapter is trained
with the base frozen and, once shipped, is frozen too.

On disk (PEFT's layout, so `peft` and the transformers ecosystem read it as it is):

    adapter_config.json          {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ..,
                                  "base_fingerprint": the base it was trained on, "task": the feature}
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight / lora_B.weight, fp16

The shipped adapters are stored in fp16 and computed in fp32: every backend computes on the same rounded
values, so the exactness rule holds for the production model as it holds for the base.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from ..atomic import replacing
from ..contract import read_json
from ..errors import CheckpointError
from .head import base_fingerprint
from .llama import PROJECTIONS, Llama, Projection, load_llama

PREFIX = "base_model.model."  # PEFT's prefix of a LoraModel's keys
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def projections(model: Llama):
    """(name, Projection) of every adaptable projection, in layer order."""
    for name, module in model.named_modules():
        if isinstance(module, Projection) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            yield name, module


def add_adapter(model: Llama, rank: int, alpha: float, seed: int = 0) -> list[nn.Parameter]:
    """Attaches a fresh adapter to every projection (A as PEFT initialises it, B zero: the production model
    starts as the base) and freezes the base; returns the adapter's parameters."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for _, proj in projections(model):
        proj.lora_A = nn.Linear(proj.in_features, rank, bias=False)
        proj.lora_B = nn.Linear(rank, proj.out_features, bias=False)
        bound = 1 / math.sqrt(proj.in_features)  # kaiming_uniform(a=sqrt(5)), PEFT's default for A
        with torch.no_grad():
            proj.lora_A.weight.copy_(torch.rand(proj.lora_A.weight.shape, generator=g) * 2 * bound - bound)
            proj.lora_B.weight.zero_()
        proj.lora_scale = alpha / rank
        params += [proj.lora_A.weight, proj.lora_B.weight]
    return params


def remove_adapter(model: Llama) -> None:
    """The base alone again."""
    for _, proj in projections(model):
        proj.lora_A = proj.lora_B = None
        proj.lora_scale = 0.0


def adapter_state(model: Llama) -> dict[str, torch.Tensor]:
    """The attached adapter's tensors under PEFT's names."""
    return {f"{PREFIX}{name}.{part}.weight": getattr(proj, part).weight.detach()
            for name, proj in projections(model) if proj.lora_A is not None for part in ("lora_A", "lora_B")}


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def save_adapter(model: Llama, directory: str | Path, rank: int, alpha: float, extra: dict) -> None:
    """Writes the attached adapter, in fp16, with its PEFT config (extra: more config keys, e.g. the
    base's fingerprint and the feature)."""
    from safetensors.torch import save_file

    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "bias": "none", "target_modules": list(PROJECTIONS), "fan_in_fan_out": False, **extra}
    state = {k: v.to(torch.float16).contiguous() for k, v in adapter_state(model).items()}
    with replacing(Path(directory), keep=True, fresh=ADAPTER_FILES) as new:  # both or neither, the card kept
        save_file(state, new / "adapter_model.safetensors", metadata={"format": "pt"})
        (new / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(directory: str | Path) -> dict:
    path = Path(directory) / "adapter_config.json"
    config = read_json(path, "not an adapter directory")
    if config.get("peft_type") != "LORA" or not isinstance(config.get("r"), int):
        raise CheckpointError(f"{path} is not a LoRA adapter's config (peft_type LORA with an integer r)")
    return config


def load_adapter(model: Llama, directory: str | Path, fingerprint: str | None = None) -> dict:
    """Attaches the adapter saved in directory (its fp16 values, computed in fp32) to model and returns its
    config; fingerprint: the base's, which the adapter must have been trained on."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    if fingerprint is not None and config.get("base_fingerprint") != fingerprint:
        raise CheckpointError(f"the adapter in {directory} was trained for another base (fingerprint "
                              f"{str(config.get('base_fingerprint'))[:12]}, this base is {fingerprint[:12]})")
    path = Path(directory) / "adapter_model.safetensors"
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is missing, corrupt or not a safetensors file: {e}") from None
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    add_adapter(model, rank, alpha)
    expected = adapter_state(model)
    if state.keys() != expected.keys():
        missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        raise CheckpointError(f"{path} does not match this base: missing {missing[:2]}, unexpected {unexpected[:2]}")
    for name, proj in projections(model):
        for part in ("lora_A", "lora_B"):
            value = state[f"{PREFIX}{name}.{part}.weight"]
            if value.shape != getattr(proj, part).weight.shape:
                raise CheckpointError(f"{path}: {name}.{part} has shape {tuple(value.shape)}, the base implies "
                                      f"{tuple(getattr(proj, part).weight.shape)}")
            with torch.no_grad():
                getattr(proj, part).weight.copy_(value.to(torch.float32))
    return config


def adapters_for(base_dir: Path, root: Path) -> tuple[Path, ...]:
    """The adapters under root (one folder each) trained on the base in base_dir, by its fingerprint: the
    default adapters of `build` (none for a base of one's own that has none)."""
    found = sorted(d for d in Path(root).glob("*") if (d / "adapter_config.json").is_file()) if Path(root).is_dir() else []
    if not found:
        return ()
    fingerprint = base_fingerprint(load_llama(base_dir))
    return tuple(d for d in found if read_adapter_config(d).get("base_fingerprint") == fingerprint)


def production_models(base_dir: Path, adapters: tuple[Path, ...] = ()) -> dict[str | None, Llama]:
    """task -> its feature's production model, the frozen base plus the task's adapter (in eval mode); None ->
    the base alone (the chat, `continue`, and a task without an adapter)."""
    models = {None: load_llama(base_dir).eval()}
    fingerprint = base_fingerprint(models[None]) if adapters else None
    for d in adapters:
        model = load_llama(base_dir).eval()
        models[load_adapter(model, d, fingerprint)["task"]] = model
    return models
