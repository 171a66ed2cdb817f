/*
 * kernel_scan: one pass over a captured CUDA graph's nodes that says, for each kernel
 * node, which function it launches and whether its parameters hold torch's captured
 * generator state (vmm_backends/cuda/generator_state.py says why a pool needs to know
 * and how the state is laid out).  Every graph a pool owns is read once, at the end of
 * its capture; in Python the reading cost about 10 us a node (0.35 ms a graph of the
 * Llama-3-8B piecewise shape), a third of what a capture costs, so it is done here.
 *
 * No CUDA header is needed: the driver's entry points are passed in as addresses (from
 * ctypes), and the one struct read is declared below as cuda.h declares it.
 *
 *   CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode,
 *                                          CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams);
 *   CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex,
 *                               size_t *paramOffset, size_t *paramSize);        12.4+
 *   CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex,
 *                                 size_t *paramOffset, size_t *paramSize);      12.4+
 *
 * The ParamInfo calls return CUDA_ERROR_INVALID_VALUE (1) past the last parameter.
 * A launch's parameters are read from kernelParams (one pointer per parameter) or from
 * the one buffer of `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER (1) -> the buffer,
 * CU_LAUNCH_PARAM_BUFFER_SIZE (2) -> a pointer to its size, CU_LAUNCH_PARAM_END (0)).
 *
 * The state is two 8-byte device addresses (seed, offset), side by side at an 8-byte
 * boundary of a parameter, with the captured_ flag (one byte, 1) 20 or 24 bytes after
 * the pair's start (at::PhiloxCudaState: 24 or 32 bytes).  Nothing here allocates,
 * keeps state between calls, exits or aborts.  Symbols carry the vmm_kernel_scan prefix.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define VMM_KERNEL_SCAN_ABI_VERSION 1

/* CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12.0+) */
typedef struct {
    void *func;
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_mem_bytes;
    void **kernel_params;
    void **extra;
    void *kern;
    void *ctx;
} kernel_node_params;

typedef int (*get_params_fn)(void *node, kernel_node_params *params);
typedef int (*param_info_fn)(void *handle, size_t index, size_t *offset, size_t *size);

/* what vmm_kernel_scan says of each node */
enum {
    SCAN_PLAIN = 0,       /* a kernel whose parameters do not hold the state */
    SCAN_HANDED = 1,      /* a kernel whose parameters hold the state */
    SCAN_NO_SIZES = 2,    /* a kernel whose parameters' sizes the driver does not give */
    SCAN_NO_BYTES = 3,    /* a kernel whose parameters are in neither place above */
    SCAN_NOT_READ = 4,    /* cuGraphKernelNodeGetParams_v2 refused (its code is kept) */
};

#define INVALID_VALUE 1
#define PAIR_BYTES 16
#define NARROWEST 24           /* the smaller at::PhiloxCudaState */
#define MAX_PARAMS 65536       /* far past any kernel: a driver that never says "past
                                  the last parameter" cannot keep the loop going */
#define MAX_EXTRA_PAIRS 32

int vmm_kernel_scan_abi_version(void) { return VMM_KERNEL_SCAN_ABI_VERSION; }

static int holds_pair(const unsigned char *p, size_t size, const unsigned char *pair)
{
    for (size_t at = 0; at + PAIR_BYTES <= size; at += 8) {
        if (memcmp(p + at, pair, PAIR_BYTES) != 0)
            continue;
        if ((at + 20 < size && p[at + 20] == 1) || (at + 24 < size && p[at + 24] == 1))
            return 1;
    }
    return 0;
}

static void extra_buffer(void **extra, const unsigned char **buffer, size_t *length)
{
    *buffer = NULL;
    *length = 0;
    if (!extra)
        return;
    for (int i = 0; i < 2 * MAX_EXTRA_PAIRS; i += 2) {
        uintptr_t key = (uintptr_t)extra[i];
        if (key == 0)
            break;
        if (key == 1)
            *buffer = (const unsigned char *)extra[i + 1];
        else if (key == 2 && extra[i + 1])
            *length = *(const size_t *)extra[i + 1];
    }
}

/* One kernel node's parameters against the pair: SCAN_PLAIN, SCAN_HANDED, SCAN_NO_SIZES
 * or SCAN_NO_BYTES. */
static int scan_params(const kernel_node_params *p, param_info_fn func_info,
                       param_info_fn kernel_info, const unsigned char *pair)
{
    void *handle = p->func ? p->func : p->kern;
    param_info_fn info = p->func ? func_info : kernel_info;
    if (!handle || !info)
        return SCAN_NO_SIZES;
    const unsigned char *buffer = NULL;
    size_t length = 0;
    int have_buffer = 0;
    for (size_t index = 0; index < MAX_PARAMS; index++) {
        size_t offset = 0, size = 0;
        int rc = info(handle, index, &offset, &size);
        if (rc == INVALID_VALUE)
            return SCAN_PLAIN;
        if (rc != 0)
            return SCAN_NO_SIZES;
        if (size < NARROWEST)
            continue;
        const unsigned char *bytes;
        if (p->kernel_params) {
            bytes = (const unsigned char *)p->kernel_params[index];
        } else {
            if (!have_buffer) {
                extra_buffer(p->extra, &buffer, &length);
                have_buffer = 1;
            }
            /* not offset + size > length: a driver's sizes near 2^64 would wrap it */
            if (!buffer || offset > length || size > length - offset)
                return SCAN_NO_BYTES;
            bytes = buffer + offset;
        }
        if (!bytes)
            return SCAN_NO_BYTES;
        if (holds_pair(bytes, size, pair))
            return SCAN_HANDED;
    }
    return SCAN_NO_SIZES;
}

/*
 * For each of `count` nodes: verdicts[i] (the enum above), funcs[i] and kerns[i] (the
 * node's CUfunction and CUkernel, NULL where it has none or was not read) and codes[i]
 * (what get_params returned).
 * `pair` (16 bytes: the seed's address, then the offset's) NULL: the parameters are
 * not read, every kernel is SCAN_PLAIN.  Returns 0, or -1 where an argument is missing.
 */
int vmm_kernel_scan(get_params_fn get_params, param_info_fn func_info,
                    param_info_fn kernel_info, void *const *nodes, size_t count,
                    const unsigned char *pair, int *verdicts, void **funcs, void **kerns,
                    int *codes)
{
    if (!get_params || (count && (!nodes || !verdicts || !funcs || !kerns || !codes)))
        return -1;
    for (size_t i = 0; i < count; i++) {
        kernel_node_params params;
        memset(&params, 0, sizeof params);  /* no field of the last node is read as this one's */
        int rc = get_params(nodes[i], &params);
        codes[i] = rc;
        if (rc != 0) {
            verdicts[i] = SCAN_NOT_READ;
            funcs[i] = kerns[i] = NULL;
            continue;
        }
        funcs[i] = params.func;
        kerns[i] = params.kern;
        verdicts[i] = pair ? scan_params(&params, func_info, kernel_info, pair) : SCAN_PLAIN;
    }
    return 0;
}
