"""Builds the C shim (csrc/vmm_shim.c) whose alloc/free the frameworks' pluggable
allocators load.  It needs only the system C compiler, no vendor SDK headers."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vmm_core._vmm_shim",
            sources=["csrc/vmm_shim.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall"],
        )
    ]
)
