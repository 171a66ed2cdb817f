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
 * when no callback is installed or the callback fails.  The callback writes the address
 * into an out-parameter that alloc sets to NULL first, rather than returning it: when a
 * Python exception escapes a ctypes callback, ctypes leaves the return value undefined
 * (a stale address was seen), while an out-parameter it never wrote stays NULL.  A
 * Ctrl-C the callback held while it made the memory comes back through its state word,
 * and alloc signals it again once the callback has returned; one that came before, while
 * the framework's own code ran, alloc takes from Python's pending signals (vmm_interrupt.h).
 *
 * free never calls Python: the caching allocator calls it while holding its own lock,
 * and the documented lock order is GIL -> allocator lock, so taking the GIL here could
 * deadlock.  Physical memory is owned by SharedVMMAllocator and reclaimed per virtual
 * space, so free only counts and forgets the segment.  It touches nothing Python owns,
 * which keeps it safe when it arrives during or after interpreter shutdown.
 *
 * The segments the framework holds (returned by alloc, not yet freed) are kept in a
 * table, so that vmm_core can ask whether the framework still holds anything in an
 * address range (vmm_shim_holds) without asking the framework: torch's own snapshot waits
 * for the allocator's lock while holding the GIL, the reverse of the order above.  The
 * table's mutex is a leaf: nothing is called while it is held.  If the table cannot grow,
 * vmm_shim_holds answers "yes" for every range from then on (addresses are then kept
 * reserved rather than risk handing them out twice); so it does while an alloc is
 * between its callback and its record, whose address it cannot know yet.
 *
 * No vendor header is needed: streams are opaque pointers.  Symbols carry the vmm_shim_
 * prefix.  Nothing here exits or aborts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "vmm_interrupt.h"

#define VMM_SHIM_ABI_VERSION 5

typedef vmm_alloc_cb vmm_shim_alloc_cb;

static _Atomic(vmm_shim_alloc_cb) g_alloc_cb = NULL;
static atomic_ullong g_allocs = 0;
static atomic_ullong g_alloc_failures = 0;
static atomic_ullong g_alloc_bytes = 0;
static atomic_ullong g_frees = 0;
static atomic_ullong g_free_bytes = 0;

typedef struct {
    uintptr_t ptr;
    size_t size;
} vmm_shim_segment;

static pthread_mutex_t g_table_lock = PTHREAD_MUTEX_INITIALIZER;
static vmm_shim_segment *g_table = NULL; /* never freed: free may come after shutdown */
static size_t g_table_len = 0;
static size_t g_table_cap = 0;
static int g_table_lost = 0; /* an insert failed: answer "held" for every range */
static atomic_int g_in_flight = 0; /* allocs not yet recorded: answer "held" meanwhile */

static void table_insert(void *ptr, size_t size) {
    pthread_mutex_lock(&g_table_lock);
    if (g_table_len == g_table_cap) {
        size_t cap = g_table_cap ? 2 * g_table_cap : 256;
        vmm_shim_segment *grown = realloc(g_table, cap * sizeof *grown);
        if (!grown) {
            g_table_lost = 1;
            pthread_mutex_unlock(&g_table_lock);
            return;
        }
        g_table = grown;
        g_table_cap = cap;
    }
    g_table[g_table_len].ptr = (uintptr_t)ptr;
    g_table[g_table_len].size = size;
    g_table_len++;
    pthread_mutex_unlock(&g_table_lock);
}

static void table_remove(void *ptr) {
    pthread_mutex_lock(&g_table_lock);
    for (size_t i = 0; i < g_table_len; i++) {
        if (g_table[i].ptr == (uintptr_t)ptr) {
            g_table[i] = g_table[--g_table_len];
            break;
        }
    }
    pthread_mutex_unlock(&g_table_lock);
}

/* A forked child may inherit the mutex locked by a thread it does not have: forked while
 * other threads asked the table in a loop, 3 of 300 children hung on their first question
 * without these handlers, none with them (a probe of 300 forks; a test of it in the
 * suite did not hang reliably enough to show the defect, so there is none). */
static void table_lock_before_fork(void) { pthread_mutex_lock(&g_table_lock); }
static void table_unlock_after_fork(void) { pthread_mutex_unlock(&g_table_lock); }
static void table_fresh_in_child(void) {
    pthread_mutex_init(&g_table_lock, NULL);
    atomic_store(&g_in_flight, 0); /* the threads that were allocating are not here */
}

__attribute__((constructor)) static void vmm_shim_init(void) {
    pthread_atfork(table_lock_before_fork, table_unlock_after_fork, table_fresh_in_child);
}

int vmm_shim_abi_version(void) { return VMM_SHIM_ABI_VERSION; }

/* 1 if the framework holds a segment overlapping [base, base + size), else 0. */
int vmm_shim_holds(uintptr_t base, size_t size) {
    int held = 0;
    pthread_mutex_lock(&g_table_lock);
    held = g_table_lost || atomic_load(&g_in_flight) > 0;
    for (size_t i = 0; !held && i < g_table_len; i++) {
        /* overlap without adding: base + size may wrap near the top of the space */
        uintptr_t p = g_table[i].ptr;
        held = p >= base ? p - base < size : base - p < g_table[i].size;
    }
    pthread_mutex_unlock(&g_table_lock);
    return held;
}

/* How many segments the framework holds now. */
unsigned long long vmm_shim_segments(void) {
    pthread_mutex_lock(&g_table_lock);
    unsigned long long n = g_table_len;
    pthread_mutex_unlock(&g_table_lock);
    return n;
}

void vmm_shim_set_alloc_callback(vmm_shim_alloc_cb cb) { atomic_store(&g_alloc_cb, cb); }

void *vmm_shim_alloc(size_t size, int device, void *stream) {
    vmm_shim_alloc_cb cb = atomic_load(&g_alloc_cb);
    atomic_fetch_add(&g_in_flight, 1);
    void *ptr = vmm_call_alloc_cb(cb, size, device, stream);
    if (ptr) {
        table_insert(ptr, size);
    }
    atomic_fetch_sub(&g_in_flight, 1);
    if (ptr) {
        atomic_fetch_add(&g_allocs, 1);
        atomic_fetch_add(&g_alloc_bytes, (unsigned long long)size);
    } else {
        atomic_fetch_add(&g_alloc_failures, 1);
    }
    return ptr;
}

void vmm_shim_free(void *ptr, size_t size, int device, void *stream) {
    table_remove(ptr);
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
