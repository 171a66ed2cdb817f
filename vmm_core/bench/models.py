"""A transformer-style decode block with random weights, for benchmarks and GPU tests.

No downloads: weights are drawn from a seeded generator, so every process of a
benchmark computes the same function.
"""

from __future__ import annotations

__all__ = ["DecodeMLP"]


class DecodeMLP:
    """``layers`` residual SwiGLU MLP blocks with RMSNorm (a Llama layer minus attention)."""

    def __init__(self, hidden=4096, ffn=14336, layers=4, dtype=None, device="cuda", seed=0):
        import torch

        dtype = dtype or torch.bfloat16
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.layers = []
        for _ in range(layers):
            def w(rows, cols):
                return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(device, dtype)

            self.layers.append((w(2 * ffn, hidden), w(hidden, ffn),
                                torch.ones(hidden, device=device, dtype=dtype)))
        self.hidden, self.dtype, self.device = hidden, dtype, device

    def __call__(self, x):
        import torch.nn.functional as F

        for gate_up, down, norm in self.layers:
            h = F.rms_norm(x, (x.shape[-1],), norm)
            g, u = (h @ gate_up.t()).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ down.t()
        return x
