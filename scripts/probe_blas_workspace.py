"""Where PyTorch puts a stream's cuBLAS workspaces, measured on plain torch (device only).

The facts ``backends/cuda/allocator_adapter.prime_library_workspaces`` relies on:
(1) the first matrix multiply on a (handle, stream) allocates a workspace that stays
allocated; (2) made inside ``torch.cuda.use_mem_pool`` it lands in that pool;
(3) ``torch.cuda.current_blas_handle()`` creates it, so that a later multiply inside the
pool allocates nothing there, for the cuBLAS path (fp32 bmm) and the cuBLASLt path
(bf16 linear with bias) alike.  Each case runs on a stream no other code has used
(created through cuda-bindings, wrapped by ``torch.cuda.ExternalStream``), since
torch's own streams come from a small recycled set.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def fresh_stream():
    from cuda.bindings import runtime

    err, raw = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
    assert int(err) == 0, err
    return torch.cuda.ExternalStream(int(raw))


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def ops():
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 32, 1, device="cuda")
    y = torch.randn(4, 1, 16, device="cuda")
    return {"linear_bf16_bias": lambda: F.linear(a, w, b),
            "bmm_fp32": lambda: x @ y,
            "mm_bf16": lambda: a @ w.t()}


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "blas", torch.backends.cuda.preferred_blas_library(),
          {k: v for k, v in os.environ.items() if "CUBLAS" in k}, flush=True)
    table = ops()
    for name, fn in table.items():  # (1): what the first multiply leaves allocated
        s = fresh_stream()
        with torch.cuda.stream(s):
            before = allocated()
            out = fn()
            del out
            print(f"(1) {name}: first use of a fresh stream leaves "
                  f"{allocated() - before} bytes allocated", flush=True)
            again = allocated()
            out = fn()
            del out
            print(f"    second use: {allocated() - again} more", flush=True)
        s2 = fresh_stream()
        with torch.cuda.stream(s2):
            before = allocated()
            torch.cuda.current_blas_handle()
            primed = allocated() - before
            out = fn()
            del out
            print(f"(3) {name}: current_blas_handle() allocates {primed}; the multiply "
                  f"after it {allocated() - before - primed} more", flush=True)
        for prime in (False, True):  # (2): inside use_mem_pool
            s3 = fresh_stream()
            pool = torch.cuda.MemPool()
            with torch.cuda.stream(s3):
                if prime:
                    torch.cuda.current_blas_handle()
                with torch.cuda.use_mem_pool(pool):
                    out = fn()
                    del out
                torch.cuda.synchronize()
                live = [b["size"] for seg in pool.snapshot() for b in seg["blocks"]
                        if b["state"] == "active_allocated"]
            print(f"(2) {name}, primed={prime}: live blocks left in the pool: {live}",
                  flush=True)
    print("probe done", flush=True)


if __name__ == "__main__":
    main()
