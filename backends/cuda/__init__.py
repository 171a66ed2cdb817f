"""NVIDIA CUDA backend: cuMem* through NVIDIA's cuda-bindings, torch.cuda.MemPool, CUDAGraph."""
