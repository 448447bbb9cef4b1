"""Moving parameters between an `nn.Module` and a store's flat per-layer state."""

from __future__ import annotations

import torch
from torch import nn

from mtc.errors import StoreError
from mtc.graphs.program import Program
from mtc.store import TensorStore, state_array_name

__all__ = ["flatten_layer", "load_into_module", "read_params"]


@torch.no_grad()
def flatten_layer(program: Program, layer: int, params: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer ``layer``'s parameters concatenated in its flat-state order, as fp32 on the CPU, or
    written into ``out`` (a 1-D fp32 tensor of the layer's size on any device; returned)."""
    specs = program.layer_params(layer)
    n = program.layer_numel(layer)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    elif out.dim() != 1 or out.numel() != n or out.dtype != torch.float32:
        raise StoreError(f"flatten_layer: layer {layer} needs a 1-D float32 buffer of {n} elements, "
                         f"got {tuple(out.shape)} {out.dtype}")
    for p in specs:
        t = params[p.key]
        if tuple(t.shape) != p.spec.shape:
            raise StoreError(f"parameter {p.key} has shape {tuple(t.shape)}, the plan expects {p.spec.shape}")
        # one pass: copy_ converts the dtype and crosses devices as it writes (no temporary)
        out[p.offset : p.offset + p.numel].copy_(t.detach().reshape(-1))
    return out


def read_params(program: Program, store: TensorStore, generation: int) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master value from state generation ``generation``."""
    out: dict[str, torch.Tensor] = {}
    for layer in range(program.n_layers):
        if not program.layer_numel(layer):
            continue
        flat = store.read(state_array_name(layer, "master", generation))
        for p in program.layer_params(layer):
            out[p.key] = flat[p.offset : p.offset + p.numel].view(p.spec.shape)
    return out


@torch.no_grad()
def load_into_module(module: nn.Module, program: Program, store: TensorStore, generation: int) -> nn.Module:
    """Copy the store's master weights into ``module`` (e.g. to generate text with it)."""
    values = read_params(program, store, generation)
    for name, p in module.named_parameters():
        if name not in values:
            raise StoreError(f"module parameter {name} is not in the store; was the store made from this model?")
        p.copy_(values[name])
    return module
