/*
 * vmm_segments: the alloc/free entry points of the framework pool that routes a whole
 * process into tagged memory (vmm_core.memory.whole_process).
 *
 * Unlike vmm_shim, whose segments all come from one SharedVMMAllocator per capture space
 * or region, every segment here is memory of its own, and a segment the framework frees
 * (empty_cache, the retry before an out-of-memory error) must give its physical memory
 * back.  free cannot do that itself: the caching allocator calls it under its own lock,
 * and the documented lock order is GIL -> allocator lock, so free never enters Python.
 * It records the address in a list and wakes whoever waits for it; Python takes the
 * list (vmm_segments_take) from a thread of its own and before every alloc, and closes
 * the segments' memory there.
 *
 * alloc forwards to a callback Python installs (it takes the GIL, as vmm_shim's does);
 * NULL, which the frameworks report as out of memory, when none is installed or it fails.
 * As in vmm_shim, the callback writes the address into an out-parameter set to NULL
 * first: ctypes leaves a callback's return value undefined when an exception escapes it.
 * A Ctrl-C it held while it made the memory comes back through its state word, and alloc
 * signals it again once the callback has returned; one that came before, while the
 * framework's own code ran, alloc takes from Python's pending signals (vmm_interrupt.h).
 *
 * Signatures follow the frameworks' pluggable allocators (the Python docstrings omit
 * `device`):  void* alloc(size_t size, int device, void* stream)
 *             void  free (void* ptr, size_t size, int device, void* stream)
 * No vendor header is needed.  Symbols carry the vmm_segments_ prefix.  Nothing here exits
 * or aborts.  If the list cannot grow, the address is dropped (its memory is then given
 * back only when the process ends) and vmm_segments_lost counts it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "vmm_interrupt.h"

#define VMM_SEGMENTS_ABI_VERSION 4

typedef vmm_alloc_cb vmm_segments_alloc_cb;

static _Atomic(vmm_segments_alloc_cb) g_alloc_cb = NULL;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_freed_cond = PTHREAD_COND_INITIALIZER;
static uintptr_t *g_freed = NULL; /* never freed: free may come after shutdown */
static size_t g_freed_len = 0;
static size_t g_freed_cap = 0;
static atomic_ullong g_lost = 0;
static atomic_ullong g_allocs = 0;
static atomic_ullong g_frees = 0;

static void lock_before_fork(void) { pthread_mutex_lock(&g_lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&g_lock); }
static void fresh_in_child(void) {
    pthread_mutex_init(&g_lock, NULL);
    pthread_cond_init(&g_freed_cond, NULL);
}

__attribute__((constructor)) static void vmm_segments_init(void) {
    pthread_atfork(lock_before_fork, unlock_after_fork, fresh_in_child);
}

int vmm_segments_abi_version(void) { return VMM_SEGMENTS_ABI_VERSION; }

void vmm_segments_set_alloc_callback(vmm_segments_alloc_cb cb) { atomic_store(&g_alloc_cb, cb); }

void *vmm_segments_alloc(size_t size, int device, void *stream) {
    vmm_segments_alloc_cb cb = atomic_load(&g_alloc_cb);
    void *ptr = vmm_call_alloc_cb(cb, size, device, stream);
    if (ptr) {
        atomic_fetch_add(&g_allocs, 1);
    }
    return ptr;
}

void vmm_segments_free(void *ptr, size_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    atomic_fetch_add(&g_frees, 1);
    pthread_mutex_lock(&g_lock);
    if (g_freed_len == g_freed_cap) {
        size_t cap = g_freed_cap ? 2 * g_freed_cap : 256;
        uintptr_t *grown = realloc(g_freed, cap * sizeof *grown);
        if (!grown) {
            atomic_fetch_add(&g_lost, 1);
            pthread_mutex_unlock(&g_lock);
            return;
        }
        g_freed = grown;
        g_freed_cap = cap;
    }
    g_freed[g_freed_len++] = (uintptr_t)ptr;
    pthread_cond_broadcast(&g_freed_cond);
    pthread_mutex_unlock(&g_lock);
}

/* Move up to `cap` freed addresses into `out`; returns how many. */
size_t vmm_segments_take(uintptr_t *out, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_freed_len < cap ? g_freed_len : cap;
    for (size_t i = 0; i < n; i++) {
        out[i] = g_freed[g_freed_len - n + i];
    }
    g_freed_len -= n;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Wait up to `timeout_ms` for a freed address; 1 if one is waiting, else 0. */
int vmm_segments_wait(int timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&g_lock);
    int rc = 0;
    while (g_freed_len == 0 && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&g_freed_cond, &g_lock, &until);
    }
    int waiting = g_freed_len > 0;
    pthread_mutex_unlock(&g_lock);
    return waiting;
}

/* 0 allocs, 1 frees, 2 addresses lost (the list could not grow) */
unsigned long long vmm_segments_counter(int which) {
    switch (which) {
    case 0: return atomic_load(&g_allocs);
    case 1: return atomic_load(&g_frees);
    case 2: return atomic_load(&g_lost);
    default: return 0;
    }
}

/* Importable as vmm_core._vmm_segments only so that the import system can locate the
 * file; Python code loads it with ctypes. */
static struct PyModuleDef vmm_segments_module = {
    PyModuleDef_HEAD_INIT, "_vmm_segments",
    "C entry points of the whole-process framework pool (load with ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__vmm_segments(void) { return PyModule_Create(&vmm_segments_module); }
