/*
 * vmm_shim: the alloc/free entry points that PyTorch's pluggable allocators
 * (torch.cuda.memory.CUDAPluggableAllocator, torch_npu NPUPluggableAllocator,
 * torch_mlu MLUPluggableAllocator) load by symbol name.
 *
 * Signatures follow the frameworks' C++ sources (the Python docstrings omit `device`):
 *   void* alloc(size_t size, int device, void* stream)
 *   void  free (void* ptr, size_t size, int device, void* stream)
 *
 * alloc forwards to a callback that Python installs (it takes the GIL, like the
 * allocators of vLLM); it returns NULL, which the frameworks report as out of memory,
 * when no callback is installed or the callback fails.
 *
 * free never calls Python: the caching allocator calls it while holding its own lock,
 * and the documented lock order is GIL -> allocator lock, so taking the GIL here could
 * deadlock.  Physical memory is owned by SharedVMMAllocator and reclaimed per virtual
 * space, so free only counts.  It touches nothing but static memory, which keeps it safe
 * when it arrives during or after interpreter shutdown.
 *
 * No vendor header is needed: streams are opaque pointers.  Symbols carry the vmm_shim_
 * prefix.  Nothing here exits or aborts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define VMM_SHIM_ABI_VERSION 1

typedef void *(*vmm_shim_alloc_cb)(size_t size, int device, void *stream);

static _Atomic(vmm_shim_alloc_cb) g_alloc_cb = NULL;
static atomic_ullong g_allocs = 0;
static atomic_ullong g_alloc_failures = 0;
static atomic_ullong g_alloc_bytes = 0;
static atomic_ullong g_frees = 0;
static atomic_ullong g_free_bytes = 0;

int vmm_shim_abi_version(void) { return VMM_SHIM_ABI_VERSION; }

void vmm_shim_set_alloc_callback(vmm_shim_alloc_cb cb) { atomic_store(&g_alloc_cb, cb); }

void *vmm_shim_alloc(size_t size, int device, void *stream) {
    vmm_shim_alloc_cb cb = atomic_load(&g_alloc_cb);
    void *ptr = cb ? cb(size, device, stream) : NULL;
    if (ptr) {
        atomic_fetch_add(&g_allocs, 1);
        atomic_fetch_add(&g_alloc_bytes, (unsigned long long)size);
    } else {
        atomic_fetch_add(&g_alloc_failures, 1);
    }
    return ptr;
}

void vmm_shim_free(void *ptr, size_t size, int device, void *stream) {
    (void)ptr;
    (void)device;
    (void)stream;
    atomic_fetch_add(&g_frees, 1);
    atomic_fetch_add(&g_free_bytes, (unsigned long long)size);
}

/* 0 allocs, 1 alloc bytes, 2 frees, 3 free bytes, 4 alloc failures */
unsigned long long vmm_shim_counter(int which) {
    switch (which) {
    case 0: return atomic_load(&g_allocs);
    case 1: return atomic_load(&g_alloc_bytes);
    case 2: return atomic_load(&g_frees);
    case 3: return atomic_load(&g_free_bytes);
    case 4: return atomic_load(&g_alloc_failures);
    default: return 0;
    }
}

/* Importable as vmm_core._vmm_shim only so that the import system can locate the file;
 * Python code loads it with ctypes. */
static struct PyModuleDef vmm_shim_module = {
    PyModuleDef_HEAD_INIT, "_vmm_shim",
    "C entry points for the frameworks' pluggable allocators (load with ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__vmm_shim(void) { return PyModule_Create(&vmm_shim_module); }
