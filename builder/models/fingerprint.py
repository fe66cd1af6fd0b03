"""A base's fingerprint: what a head, a drafter, an adapter and an imported GGUF record of the base they
belong to. Apart from llama.py, so that the GGUF import (gguf.py), which llama.py calls, can use it."""
from __future__ import annotations

import hashlib

import torch


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a base's parameter names, shapes and values to fp16 precision (independent of file
    layout and of the precision it is stored or run in: a head runs on its base in fp32 and in fp16, and a
    base saved in fp16 after fp32 training is the same base). An attached adapter does not change it."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        if ".lora_" in name:  # an attached adapter is not the base's
            continue
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.detach().to("cpu", torch.float16).contiguous().numpy().tobytes())
    return h.hexdigest()


def base_fingerprint(base: torch.nn.Module) -> str:
    """The fingerprint of a loaded base (a models.llama.Llama)."""
    return state_fingerprint(base.state_dict())
