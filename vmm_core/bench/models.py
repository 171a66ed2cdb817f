"""A transformer-style decode block with random weights, for benchmarks and GPU tests.

No downloads: weights are drawn from a seeded generator, so every process of a
benchmark computes the same function.
"""

from __future__ import annotations

__all__ = ["DecodeMLP", "LlamaStack"]


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


class LlamaStack:
    """A stack of ``transformers`` ``LlamaDecoderLayer`` s (random init) run as a decode step.

    Why not ``LlamaModel``: a decode step is one token per sequence attending to a KV cache,
    and engines capture it either whole (one graph per batch size) or *piecewise* (vLLM:
    split at attention, every other op captured per piece, attention eager in between).
    This class exposes both shapes over the same layer weights, so the full and the
    piecewise runners compute the same function and can be checked against each other.

    ``x`` is ``[batch, hidden]``.  Every sequence attends to ``ctx`` cached tokens (random,
    fixed, one cache row per batch row) plus its own new token; the cache is not updated,
    so a step is a pure function of ``x``.  Needs the optional ``bench`` extra
    (``pip install 'vmm_core[bench]'`` installs transformers).
    """

    def __init__(self, layers=4, hidden=2048, ffn=5632, heads=32, kv_heads=4, ctx=64,
                 max_batch=512, dtype=None, device="cuda", seed=0, side_stream=False):
        import torch

        try:
            from transformers import LlamaConfig
            from transformers.models.llama import modeling_llama
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the llama benchmark model needs transformers: "
                              "pip install 'vmm_core[bench]'") from exc
        dtype = dtype or torch.bfloat16
        config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, max_position_embeddings=ctx + 1,
                             vocab_size=32)
        config._attn_implementation = "eager"
        self._rope = modeling_llama.apply_rotary_pos_emb
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = [modeling_llama.LlamaDecoderLayer(config, layer_idx=i)
                           .to(device=device, dtype=dtype).eval() for i in range(layers)]
            rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
            gen = torch.Generator(device="cpu").manual_seed(seed + 1)
            head_dim = hidden // heads
            shape = (max_batch, kv_heads, ctx, head_dim)
            self.cache = [(torch.randn(shape, generator=gen).to(device, dtype),
                           torch.randn(shape, generator=gen).to(device, dtype))
                          for _ in range(layers)]
        with torch.no_grad():
            position = torch.full((1, 1), ctx, device=device)
            probe = torch.zeros(1, 1, hidden, device=device, dtype=dtype)
            self.cos, self.sin = rotary(probe, position)  # [1, 1, head_dim], outside any pool
        # the MLP's gate on a second stream, as engines overlap shared experts: blocks used
        # across streams are freed late inside a capture unless record-stream reuse is on
        self.side = getattr(torch, torch.device(device).type).Stream(device=device) \
            if side_stream else None
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads
        self.head_dim, self.dtype, self.device, self.max_batch = head_dim, dtype, device, max_batch

    # ------------------------------------------------------------------ whole step
    def __call__(self, x):
        import torch

        with torch.no_grad():
            for i in range(len(self.layers)):
                residual, q, k, v = self._qkv(i, x)
                x = self._post_attention(i, residual, self._attend(i, q, k, v))
            return x

    # ------------------------------------------------------------------ pieces (vLLM's split)
    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def piece(self, index: int, *inputs):
        """Piece ``index`` of the piecewise split: what lies between two attentions.

        Piece 0 takes ``(x,)``; piece i > 0 takes ``(residual, attn_out)`` of layer i-1.
        Pieces before the last return ``(residual, q, k, v, attn_out)`` where ``attn_out``
        is an empty buffer the eager attention writes into (vLLM's attention op writes its
        output in place, so the next piece reads a buffer the previous piece allocated).
        """
        import torch

        with torch.no_grad():
            if index == 0:
                (x,) = inputs
            else:
                residual, attn = inputs
                x = self._post_attention(index - 1, residual, attn)
            if index == len(self.layers):
                return x
            residual, q, k, v = self._qkv(index, x)
            out = torch.empty(x.shape[0], self.heads * self.head_dim, device=x.device,
                              dtype=x.dtype)
            return residual, q, k, v, out

    def attention(self, index: int, q, k, v, out) -> None:
        """The eager part between pieces: layer ``index``'s attention, written into ``out``."""
        import torch

        with torch.no_grad():
            out.copy_(self._attend(index, q, k, v))

    # ------------------------------------------------------------------ the math
    def _qkv(self, i, x):
        layer = self.layers[i]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        n = x.shape[0]
        q = attn.q_proj(h).view(n, self.heads, 1, self.head_dim)
        k = attn.k_proj(h).view(n, self.kv_heads, 1, self.head_dim)
        v = attn.v_proj(h).view(n, self.kv_heads, 1, self.head_dim)
        q, k = self._rope(q, k, self.cos, self.sin)
        return x, q, k, v

    def _attend(self, i, q, k, v):
        import torch
        import torch.nn.functional as F

        n = q.shape[0]
        k_cache, v_cache = self.cache[i]
        keys = torch.cat((k_cache[:n], k), dim=2)
        values = torch.cat((v_cache[:n], v), dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        return out.reshape(n, self.heads * self.head_dim)

    def _post_attention(self, i, residual, attn):
        layer = self.layers[i]
        x = residual + layer.self_attn.o_proj(attn)
        h = layer.post_attention_layernorm(x)
        if self.side is None:
            return x + layer.mlp(h)
        import torch

        mlp, mod = layer.mlp, getattr(torch, h.device.type)
        main = mod.current_stream(h.device)
        self.side.wait_stream(main)
        with mod.stream(self.side):
            gate = mlp.act_fn(mlp.gate_proj(h))
        h.record_stream(self.side)
        up = mlp.up_proj(h)
        main.wait_stream(self.side)
        gate.record_stream(main)
        return x + mlp.down_proj(gate * up)
