"""A transformer-style decode block with random weights, for benchmarks and GPU tests.

No downloads: weights are drawn from a seeded generator, so every process of a
benchmark computes the same function.
"""

from __future__ import annotations

__all__ = ["DecodeMLP", "LlamaStack", "SideStreamStack"]


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
                 max_batch=512, dtype=None, device="cuda", seed=0):
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
        # weights and cache are drawn on the device itself: the 8B shape (32 layers of
        # 218M parameters, a 4 GiB cache) would take minutes to initialise on a CPU
        device = torch.device(device)
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(seed)
            self.layers = [modeling_llama.LlamaDecoderLayer(config, layer_idx=i)
                           .to(dtype=dtype).eval() for i in range(layers)]
            rotary = modeling_llama.LlamaRotaryEmbedding(config)
            gen = torch.Generator(device=device).manual_seed(seed + 1)
            head_dim = hidden // heads
            shape = (max_batch, kv_heads, ctx, head_dim)
            self.cache = [(torch.randn(shape, generator=gen, dtype=dtype),
                           torch.randn(shape, generator=gen, dtype=dtype))
                          for _ in range(layers)]
        with torch.no_grad():
            position = torch.full((1, 1), ctx, device=device)
            probe = torch.zeros(1, 1, hidden, device=device, dtype=dtype)
            # [1, 1, head_dim]; a matrix multiply: in the caller's region, if any
            self.cos, self.sin = rotary(probe, position)
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
        return x + layer.mlp(h)


class SideStreamStack:
    """PyTorch PR 158352's case: layers that each make a large temporary on the main
    stream, let a side stream read it (``record_stream``) and join the side stream again.

    Inside a graph capture the caching allocator cannot reuse a block freed while another
    stream has used it until the capture ends, unless ``graph_capture_record_stream_reuse``
    is on (torch >= 2.9): then the join makes it reusable at once.  Without the flag one
    graph holds a temporary per layer; with it, about one.  ``x`` is ``[batch, hidden]``;
    the temporaries have ``temp_bytes`` each whatever the batch.
    """

    def __init__(self, layers=16, hidden=1024, temp_bytes=64 << 20, dtype=None,
                 device="cuda", seed=0):
        import torch

        dtype = dtype or torch.bfloat16
        device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        elems = temp_bytes // torch.empty((), dtype=dtype).element_size()
        self.rows = max(1, elems // hidden)
        self.weights = [(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5)
                        .to(device, dtype) for _ in range(layers)]
        self.spread = torch.randn(self.rows, 1, generator=gen).to(device, dtype)
        self.hidden, self.dtype, self.device = hidden, dtype, device
        mod = getattr(torch, device.type, None)
        self.side = mod.Stream(device=device) if device.type != "cpu" else None

    def __call__(self, x):
        import torch

        with torch.no_grad():
            for w in self.weights:
                x = self._layer(x, w)
            return x

    def _layer(self, x, w):
        import torch

        h = x @ w
        # the temporary: made on the main stream, [rows, hidden], temp_bytes
        tmp = self.spread * h.mean(dim=0, keepdim=True)
        if self.side is None:
            return torch.tanh(h + tmp.mean(dim=0))
        mod = getattr(torch, self.device.type)
        main = mod.current_stream(self.device)
        self.side.wait_stream(main)
        with mod.stream(self.side):
            summary = tmp.mean(dim=0)  # the side stream reads the temporary
        tmp.record_stream(self.side)
        main.wait_stream(self.side)  # the join
        summary.record_stream(main)
        return torch.tanh(h + summary)
