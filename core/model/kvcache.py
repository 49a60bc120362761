"""The KV cache: preallocated per layer in CPU memory, one contiguous row per batch slot.

Layout per layer: K and V `[S, Hkv, Tmax, hd]` (S = slots = the batch size). A slot belongs to one
request at a time; a request's tokens occupy positions [0, length) of its row, so nothing is padded
across requests and decode attention reads each row only up to its own length.
"""

from __future__ import annotations

import torch

from core.model.spec import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, slots: int, max_tokens: int, dtype: torch.dtype, pin: bool = False):
        shape = (slots, spec.num_kv_heads, max_tokens, spec.head_dim)
        self.k = [_alloc(shape, dtype, pin) for _ in range(spec.num_layers)]
        self.v = [_alloc(shape, dtype, pin) for _ in range(spec.num_layers)]
        self.slots, self.max_tokens = slots, max_tokens

    @property
    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """One token per slot: k, v [B, Hkv, hd] at (slots[b], positions[b])."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def write_prompt(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor):
        """A whole prompt for one slot: k, v [T, Hkv, hd] at positions [0, T)."""
        T = k.shape[0]
        self.k[layer][slot, :, :T] = k.transpose(0, 1)
        self.v[layer][slot, :, :T] = v.transpose(0, 1)


def _alloc(shape, dtype, pin: bool) -> torch.Tensor:
    # pinned so KV rows can go to the GPU asynchronously (S4); pageable when pinning is refused
    if pin:
        try:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.zeros(shape, dtype=dtype)
