/*
 * cndrv_emu: an EMULATED libcndrv for tests.  No MLU hardware is involved and nothing here
 * claims to reproduce the real driver beyond what its public header documents.
 *
 * It exports the CNDrv symbols vmm_backends.mlu calls, with the signatures, struct layouts,
 * enum values and CNresult codes of Cambricon's cn_api.h (CNDrv 2.15.5, "Copyright (C)
 * [2023] by Cambricon"), read from a public copy of that header in the code-search index
 * (index file id 3117644529; the index did not name its repository), plus the constraints
 * stated in the CNDrv developer guide section 6.5.8 (Virtual Memory Management).
 *
 * Memory is real so that aliasing is real: a physical handle is a memfd, a reservation is an
 * mmap(PROT_NONE), cnMemMap maps the handle's memfd MAP_SHARED|MAP_FIXED but PROT_NONE,
 * cnMemSetAccess makes it readable (and writable), cnMemUnmap puts PROT_NONE anonymous
 * memory back so the range stays reserved.  Device addresses are host addresses, so the
 * copy calls are memcpy after checking that every byte is mapped and accessible: a bad
 * address is an error code, never a crash.
 *
 * Documented constraints enforced (code returned):
 *   - any call but cnInit / cnGetLibVersion before cnInit       CN_ERROR_NOT_INITIALIZED
 *   - copies and cnCtxSync without a current context              CN_CONTEXT_ERROR_INVALID
 *   - cnMemCreate: bad prop.type / location.type / flags / size   CN_ERROR_INVALID_VALUE
 *                  requestedHandleTypes not NONE or POSIX_FD      CN_ERROR_INVALID_VALUE
 *                  location.id not a device                       CN_ERROR_INVALID_DEVICE
 *                  more than the device capacity                  CN_MEMORY_ERROR_OUT_OF_MEMORY
 *   - cnMemExportToShareableHandle: null output, flags != 0, a type
 *                  other than POSIX_FD, unknown handle            CN_ERROR_INVALID_VALUE
 *                  handle created without POSIX_FD requested
 *                  (emulator choice)                               CN_OPS_ERROR_NOT_SUPPORTED
 *   - cnMemImportFromShareableHandle: null output, a type other
 *                  than POSIX_FD, a descriptor that is not an
 *                  exported handle of this emulator               CN_ERROR_INVALID_VALUE
 *   - cnMemSetAccess on an imported handle for a device other than
 *                  the one holding the memory (no peer access)    CN_ERROR_INVALID_VALUE
 *   - cnMemAddressReserve: size/alignment not granular, flags     CN_ERROR_INVALID_VALUE
 *   - cnMemAddressFree: not a reservation start                    CN_MEMORY_ERROR_INVALID_ADDRESS
 *                       size differs from the reservation,
 *                       mappings still inside (guide 6.5.8.3)      CN_ERROR_INVALID_VALUE
 *   - cnMemMap: offset != 0, size != handle size, unaligned
 *               address or size, flags != 0, unknown handle      CN_ERROR_INVALID_VALUE
 *               outside a reservation or over a mapping         CN_MEMORY_ERROR_INVALID_ADDRESS
 *   - cnMemSetAccess: count != 1, bad desc fields, location.id
 *                     not the handle's device                   CN_ERROR_INVALID_VALUE
 *                     range not fully mapped                    CN_MEMORY_ERROR_INVALID_ADDRESS
 *                     part of a mapping (emulator choice)       CN_OPS_ERROR_NOT_SUPPORTED
 *   - cnMemUnmap: sub-range or other size of a mapping          CN_ERROR_INVALID_VALUE
 *                 nothing mapped there                          CN_MEMORY_ERROR_INVALID_ADDRESS
 *   - cnMemRelease of an unknown handle                          CN_ERROR_INVALID_VALUE
 *
 * Sharing: an exported handle is a new descriptor of the handle's memfd (whose name records
 * the device), and importing it in another process maps the very same pages.  The header
 * does not say how a descriptor travels in cnMemImportFromShareableHandle's `void
 * *osHandle`; the emulator takes the descriptor's value as the pointer, the CUDA driver's
 * convention for the same call.
 *
 * Choices the header leaves open, made conservatively and marked "emulator choice":
 *   - one cnMemSetAccess may cover a run of whole adjacent mappings, but not part of one
 *     (the header only says the range must be "a fully mapped address range"; the guide's
 *     example, 6.5.8.6, sets access per handle).  A run is accepted because torch_mlu's
 *     caching_allocator.cpp is reported to call cnMemSetAccess once over several
 *     mappings (the MLU backend declares set_access_spans_mappings for it); that call
 *     was NOT found in the sources the code index holds (Cambricon/torch_mlu at d578002,
 *     2024-09, has no expandable segments and no cnMemSetAccess), so it is unverified;
 *   - cnMemExportToShareableHandle's `void *shareableHandle`: cn_api.h does not state how
 *     many bytes a POSIX descriptor takes there.  The emulator writes an int by default
 *     and 8 bytes after emu_set_export_fd_width(8), so tests can show that a caller with a
 *     4-byte buffer would be overrun;
 *   - cnMemRelease of a still-mapped handle SUCCEEDS and defers the free to the last unmap,
 *     as the guide (6.5.8.2) and the header describe; emu_pending_frees() counts those.
 *
 * Test-only symbols carry the emu_ prefix.  Nothing here exits or aborts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "emu_array.h"

/* ---------------------------------------------------------------- cn_api.h types */
typedef uint64_t cn_uint64_t;
typedef uint32_t cn_uint32_t;
typedef cn_uint64_t CNaddr;
typedef cn_uint64_t CNdev;
typedef cn_uint64_t CNmemGenericAllocationHandle;
typedef struct CNcontext_st *CNcontext;

typedef enum {
    CN_SUCCESS = 0,
    CN_ERROR_NOT_INITIALIZED = 100002,
    CN_ERROR_NO_DEVICE = 100004,
    CN_ERROR_INVALID_DEVICE = 100005,
    CN_ERROR_INVALID_VALUE = 100006,
    CN_ERROR_OPERATING_SYSTEM = 100007,
    CN_ERROR_SYSTEM_OUT_OF_MEMORY = 100010,
    CN_OPS_ERROR_NOT_SUPPORTED = 100050,
    CN_MEMORY_ERROR_OUT_OF_MEMORY = 100100,
    CN_MEMORY_ERROR_INVALID_ADDRESS = 100102,
    CN_CONTEXT_ERROR_INVALID = 100201,
} CNresult;

typedef enum cn_memory_access_flags {
    CN_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x0,
    CN_MEM_ACCESS_FLAGS_PROT_READONLY = 0x1,
} CNMemoryAccessFlags;
typedef enum cn_caching_type {
    CN_MEM_NON_CACHEABLE = 0x0,
    CN_MEM_CACHEABLE_READONLY = 0x1,
    CN_MEM_CACHEABLE_WRITEONLY = 0x2,
    CN_MEM_CACHEABLE_READWRITE = 0x3,
} CNMemoryCachingType;
typedef enum cn_caching_pinned {
    CN_MEM_CACHE_NON_PINNED = 0x0,
    CN_MEM_CACHE_PINNED = 0x1,
} CNMemoryCachePinnedType;
typedef enum cn_mem_location_type {
    CN_MEM_LOCATION_TYPE_INVALID = 0x0,
    CN_MEM_LOCATION_TYPE_DEVICE = 0x1,
} CNmemLocationType;
typedef enum cn_mem_allocation_type {
    CN_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CN_MEM_ALLOCATION_TYPE_DEFAULT = 0x1,
} CNmemAllocationType;
typedef enum cn_mem_allocation_granularity {
    CN_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CN_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CNmemAllocationGranularity;
typedef enum cn_mem_allocation_handle_type {
    CN_MEM_HANDLE_TYPE_NONE = 0x0,
    CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
} CNmemAllocationHandleType;

typedef enum {
    CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0x30C,
} CNdevice_attribute; /* only the value the emulator answers */

typedef struct cn_mem_location {
    CNmemLocationType type;
    cn_uint32_t id;
} CNmemLocation;

typedef struct cn_mem_access_desc {
    CNmemLocation location;
    CNMemoryAccessFlags accessFlags;
    CNMemoryCachingType cacheType;
    CNMemoryCachePinnedType pinnedType;
} CNmemAccessDesc;

typedef struct cn_mem_allocation_prop {
    CNmemAllocationType type;
    CNmemAllocationHandleType requestedHandleTypes;
    CNmemLocation location;
    struct {
        unsigned char compressionType;
        unsigned char securityType;
    } allocFlags;
} CNmemAllocationProp;

/* ---------------------------------------------------------------- emulator state */
#define EMU_GRANULARITY ((uint64_t)2 << 20) /* 2 MiB, minimum and recommended */
#define EMU_DEVICES 2
#define EMU_DEVICE_TAG 0xCD000000ULL   /* CNdev values are opaque, not ordinals */
#define EMU_HANDLE_TAG 0x4A000000ULL   /* so is every allocation handle */

typedef struct {
    int fd;
    uint64_t size;
    uint32_t device;
    int mapcount;
    int released; /* cnMemRelease called; freed when mapcount drops to 0 */
    int live;
    int exportable; /* created with requestedHandleTypes = POSIX_FD */
    int imported;   /* from cnMemImportFromShareableHandle: another handle's memory */
} emu_handle;

typedef struct {
    uint64_t start, size;
} emu_range;

typedef struct {
    uint64_t start, size;
    size_t handle; /* index into g_handles */
    int access;    /* -1 none, else CNMemoryAccessFlags */
} emu_mapping;

struct CNcontext_st {
    uint32_t device;
    int magic;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized = 0;
static uint64_t g_capacity = (uint64_t)8 << 30; /* per device */
static uint64_t g_used[EMU_DEVICES];
static struct CNcontext_st g_shared_ctx[EMU_DEVICES];
static int g_shared_refs[EMU_DEVICES];
static __thread CNcontext t_current = NULL;

static emu_handle *g_handles = NULL;
static size_t g_nhandles = 0, g_caphandles = 0;
static emu_range *g_ranges = NULL;
static size_t g_nranges = 0, g_capranges = 0;
static emu_mapping *g_maps = NULL;
static size_t g_nmaps = 0, g_capmaps = 0;
static unsigned long long g_pending_frees = 0;

static int aligned(uint64_t v) { return (v % EMU_GRANULARITY) == 0; }

static int context_ok(void) {
    return t_current != NULL && t_current->magic == 0x6d6c75 &&
           g_shared_refs[t_current->device] > 0;
}

static emu_handle *lookup_handle(CNmemGenericAllocationHandle h, size_t *index) {
    if (h < EMU_HANDLE_TAG) return NULL;
    uint64_t i = h - EMU_HANDLE_TAG;
    if (i >= g_nhandles || !g_handles[i].live || g_handles[i].released) return NULL;
    if (index) *index = (size_t)i;
    return &g_handles[i];
}

static emu_range *range_containing(uint64_t addr, uint64_t size) {
    for (size_t i = 0; i < g_nranges; i++) {
        emu_range *r = &g_ranges[i];
        if (r->start <= addr && addr + size <= r->start + r->size && addr + size >= addr)
            return r;
    }
    return NULL;
}

static emu_mapping *mapping_at(uint64_t addr) {
    for (size_t i = 0; i < g_nmaps; i++)
        if (g_maps[i].start <= addr && addr < g_maps[i].start + g_maps[i].size) return &g_maps[i];
    return NULL;
}

static void free_handle_storage(emu_handle *h) {
    if (h->fd >= 0) close(h->fd);
    h->fd = -1;
    if (!h->imported && h->device < EMU_DEVICES && g_used[h->device] >= h->size)
        g_used[h->device] -= h->size;
    h->live = 0;
}

/* Every byte of [addr, addr+size) is mapped with access allowing the copy. */
static int range_accessible(uint64_t addr, uint64_t size, int need_write) {
    if (size == 0) return 1;
    if (addr + size < addr) return 0;
    uint64_t cur = addr, end = addr + size;
    while (cur < end) {
        emu_mapping *m = mapping_at(cur);
        if (!m || m->access < 0) return 0;
        if (need_write && m->access != CN_MEM_ACCESS_FLAGS_PROT_READWRITE) return 0;
        cur = m->start + m->size;
    }
    return 1;
}

static int valid_location(const CNmemLocation *loc) {
    return loc->type == CN_MEM_LOCATION_TYPE_DEVICE;
}

#define LOCKED_INIT_CHECK()                                                                  \
    do {                                                                                     \
        pthread_mutex_lock(&g_lock);                                                         \
        if (!g_initialized) {                                                                \
            pthread_mutex_unlock(&g_lock);                                                   \
            return CN_ERROR_NOT_INITIALIZED;                                                 \
        }                                                                                    \
    } while (0)
#define RETURN_UNLOCK(code)                                                                  \
    do {                                                                                     \
        CNresult rc__ = (code);                                                              \
        pthread_mutex_unlock(&g_lock);                                                       \
        return rc__;                                                                         \
    } while (0)

/* ---------------------------------------------------------------- init, devices, contexts */
CNresult cnInit(unsigned int flags) {
    if (flags != 0) return CN_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        for (uint32_t d = 0; d < EMU_DEVICES; d++) {
            g_shared_ctx[d].device = d;
            g_shared_ctx[d].magic = 0x6d6c75;
        }
        g_initialized = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return CN_SUCCESS;
}

/* Version 0.0.0 on purpose: this is not a Cambricon library. */
CNresult cnGetLibVersion(int *major, int *minor, int *patch) {
    if (!major || !minor || !patch) return CN_ERROR_INVALID_VALUE;
    *major = 0;
    *minor = 0;
    *patch = 0;
    return CN_SUCCESS;
}

CNresult cnDeviceGetCount(int *pcount) {
    if (!pcount) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    *pcount = EMU_DEVICES;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnDeviceGet(CNdev *pdev, int ordinal) {
    if (!pdev) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (ordinal < 0 || ordinal >= EMU_DEVICES) RETURN_UNLOCK(CN_ERROR_INVALID_DEVICE);
    *pdev = EMU_DEVICE_TAG + (CNdev)ordinal;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnSharedContextAcquire(CNcontext *pctx, CNdev dev) {
    if (!pctx) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (dev < EMU_DEVICE_TAG || dev >= EMU_DEVICE_TAG + EMU_DEVICES)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE); /* an ordinal is not a CNdev */
    uint32_t d = (uint32_t)(dev - EMU_DEVICE_TAG);
    g_shared_refs[d]++;
    *pctx = &g_shared_ctx[d];
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnSharedContextRelease(CNdev dev) {
    LOCKED_INIT_CHECK();
    if (dev < EMU_DEVICE_TAG || dev >= EMU_DEVICE_TAG + EMU_DEVICES)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    uint32_t d = (uint32_t)(dev - EMU_DEVICE_TAG);
    if (g_shared_refs[d] <= 0) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    g_shared_refs[d]--;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnCtxSetCurrent(CNcontext ctx) {
    LOCKED_INIT_CHECK();
    if (ctx == NULL) {
        t_current = NULL;
        RETURN_UNLOCK(CN_SUCCESS);
    }
    int known = 0;
    for (int d = 0; d < EMU_DEVICES; d++)
        if (ctx == &g_shared_ctx[d] && g_shared_refs[d] > 0) known = 1;
    if (!known) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    t_current = ctx;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnCtxGetCurrent(CNcontext *pctx) {
    if (!pctx) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    *pctx = t_current;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnCtxSync(void) {
    LOCKED_INIT_CHECK();
    if (!context_ok()) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    RETURN_UNLOCK(CN_SUCCESS); /* copies are synchronous here: nothing is queued */
}

/* ---------------------------------------------------------------- granularity */
CNresult cnMemGetAllocationGranularity(cn_uint64_t *granularity, CNmemAllocationProp *prop,
                                       CNmemAllocationGranularity options) {
    if (!granularity || !prop) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (prop->type != CN_MEM_ALLOCATION_TYPE_DEFAULT || !valid_location(&prop->location))
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (options != CN_MEM_ALLOC_GRANULARITY_MINIMUM &&
        options != CN_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    *granularity = EMU_GRANULARITY;
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- physical handles */
CNresult cnMemCreate(CNmemGenericAllocationHandle *phandle, cn_uint64_t size,
                     CNmemAllocationProp *prop, cn_uint64_t flags) {
    if (!phandle || !prop) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (flags != 0 || size == 0 || !aligned(size)) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (prop->type != CN_MEM_ALLOCATION_TYPE_DEFAULT || !valid_location(&prop->location))
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (prop->requestedHandleTypes != CN_MEM_HANDLE_TYPE_NONE &&
        prop->requestedHandleTypes != CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (prop->location.id >= EMU_DEVICES) RETURN_UNLOCK(CN_ERROR_INVALID_DEVICE);
    uint32_t dev = prop->location.id;
    if (size > g_capacity || g_used[dev] > g_capacity - size)
        RETURN_UNLOCK(CN_MEMORY_ERROR_OUT_OF_MEMORY);
    if (grow((void **)&g_handles, &g_caphandles, g_nhandles + 1, sizeof(emu_handle)))
        RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    char name[32]; /* the device is in the name, so an importer knows where the memory is */
    snprintf(name, sizeof name, "cndrv_emu:dev%u", dev);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) RETURN_UNLOCK(CN_MEMORY_ERROR_OUT_OF_MEMORY);
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        RETURN_UNLOCK(CN_MEMORY_ERROR_OUT_OF_MEMORY);
    }
    emu_handle *h = &g_handles[g_nhandles];
    h->fd = fd;
    h->size = size;
    h->device = dev;
    h->mapcount = 0;
    h->released = 0;
    h->live = 1;
    h->exportable = prop->requestedHandleTypes == CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    h->imported = 0;
    g_used[dev] += size;
    *phandle = EMU_HANDLE_TAG + g_nhandles;
    g_nhandles++;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemRelease(CNmemGenericAllocationHandle handle) {
    LOCKED_INIT_CHECK();
    emu_handle *h = lookup_handle(handle, NULL);
    if (!h) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (h->mapcount > 0) {
        /* emulator follows the guide: the free waits for the last cnMemUnmap */
        h->released = 1;
        g_pending_frees++;
        RETURN_UNLOCK(CN_SUCCESS);
    }
    free_handle_storage(h);
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- address ranges */
CNresult cnMemAddressReserve(CNaddr *pmluAddr, cn_uint64_t size, cn_uint64_t alignment,
                             CNaddr start, cn_uint64_t flags) {
    if (!pmluAddr) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (flags != 0 || size == 0 || !aligned(size) || !aligned(start))
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (alignment != 0) {
        /* "a power of two of the default alignment or 0" */
        if (!aligned(alignment)) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
        uint64_t k = alignment / EMU_GRANULARITY;
        if (k & (k - 1)) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    } else {
        alignment = EMU_GRANULARITY;
    }
    if (grow((void **)&g_ranges, &g_capranges, g_nranges + 1, sizeof(emu_range)))
        RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    uint64_t total = size + alignment;
    if (total < size) RETURN_UNLOCK(CN_MEMORY_ERROR_OUT_OF_MEMORY);
    void *base = mmap((void *)(uintptr_t)start, total, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) RETURN_UNLOCK(CN_MEMORY_ERROR_OUT_OF_MEMORY);
    uint64_t b = (uint64_t)(uintptr_t)base;
    uint64_t s = (b + alignment - 1) / alignment * alignment;
    if (s > b) munmap(base, s - b);
    uint64_t tail = b + total - (s + size);
    if (tail) munmap((void *)(uintptr_t)(s + size), tail);
    g_ranges[g_nranges].start = s;
    g_ranges[g_nranges].size = size;
    g_nranges++;
    *pmluAddr = s;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemAddressFree(CNaddr mluAddr, cn_uint64_t size) {
    LOCKED_INIT_CHECK();
    size_t i;
    for (i = 0; i < g_nranges; i++)
        if (g_ranges[i].start == mluAddr) break;
    if (i == g_nranges) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    if (g_ranges[i].size != size) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    for (size_t m = 0; m < g_nmaps; m++)
        if (g_maps[m].start >= mluAddr && g_maps[m].start < mluAddr + size)
            RETURN_UNLOCK(CN_ERROR_INVALID_VALUE); /* guide 6.5.8.3: unmap first */
    munmap((void *)(uintptr_t)mluAddr, size);
    g_ranges[i] = g_ranges[g_nranges - 1];
    g_nranges--;
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- mapping */
static unsigned long long g_set_access_calls; /* successful cnMemSetAccess calls */

CNresult cnMemMap(CNaddr mluAddr, cn_uint64_t size, cn_uint64_t offset,
                  CNmemGenericAllocationHandle handle, cn_uint64_t flags) {
    LOCKED_INIT_CHECK();
    size_t hi;
    emu_handle *h = lookup_handle(handle, &hi);
    if (!h) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (flags != 0 || offset != 0) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (size == 0 || !aligned(size) || !aligned(mluAddr)) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (size != h->size) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE); /* whole handle only */
    if (!range_containing(mluAddr, size)) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    for (size_t m = 0; m < g_nmaps; m++)
        if (g_maps[m].start < mluAddr + size && mluAddr < g_maps[m].start + g_maps[m].size)
            RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    if (grow((void **)&g_maps, &g_capmaps, g_nmaps + 1, sizeof(emu_mapping)))
        RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    void *got = mmap((void *)(uintptr_t)mluAddr, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                     h->fd, 0);
    if (got == MAP_FAILED) RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    g_maps[g_nmaps].start = mluAddr;
    g_maps[g_nmaps].size = size;
    g_maps[g_nmaps].handle = hi;
    g_maps[g_nmaps].access = -1;
    g_nmaps++;
    h->mapcount++;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemSetAccess(CNaddr mluAddr, cn_uint64_t size, CNmemAccessDesc *desc,
                        cn_uint64_t count) {
    LOCKED_INIT_CHECK();
    if (!desc || count != 1) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (!valid_location(&desc->location) || desc->location.id >= EMU_DEVICES)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (desc->accessFlags != CN_MEM_ACCESS_FLAGS_PROT_READWRITE &&
        desc->accessFlags != CN_MEM_ACCESS_FLAGS_PROT_READONLY)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if ((unsigned)desc->cacheType > CN_MEM_CACHEABLE_READWRITE ||
        (unsigned)desc->pinnedType > CN_MEM_CACHE_PINNED)
        RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (size == 0) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (mluAddr + size < mluAddr) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    emu_mapping *m = mapping_at(mluAddr);
    if (!m) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    /* the whole range must be mapped ("a fully mapped address range"), as a run of whole
     * mappings (emulator choice: part of a mapping is refused; a run is accepted, see the
     * header comment), every one of them memory of the described device */
    uint64_t cur = mluAddr;
    while (cur < mluAddr + size) {
        emu_mapping *n = mapping_at(cur);
        if (!n) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
        if (n->start != cur || n->start + n->size > mluAddr + size)
            RETURN_UNLOCK(CN_OPS_ERROR_NOT_SUPPORTED);
        if (g_handles[n->handle].device != desc->location.id)
            RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
        cur = n->start + n->size;
    }
    (void)m;
    int prot = desc->accessFlags == CN_MEM_ACCESS_FLAGS_PROT_READWRITE
                   ? (PROT_READ | PROT_WRITE) : PROT_READ;
    if (mprotect((void *)(uintptr_t)mluAddr, size, prot) != 0)
        RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    for (cur = mluAddr; cur < mluAddr + size;) {
        emu_mapping *n = mapping_at(cur);
        n->access = (int)desc->accessFlags;
        cur = n->start + n->size;
    }
    g_set_access_calls++;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemUnmap(CNaddr mluAddr, cn_uint64_t size) {
    LOCKED_INIT_CHECK();
    emu_mapping *m = mapping_at(mluAddr);
    if (!m) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    if (m->start != mluAddr || m->size != size) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    void *got = mmap((void *)(uintptr_t)mluAddr, size, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (got == MAP_FAILED) RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    emu_handle *h = &g_handles[m->handle];
    h->mapcount--;
    if (h->released && h->mapcount == 0) {
        free_handle_storage(h);
        g_pending_frees--;
    }
    *m = g_maps[g_nmaps - 1];
    g_nmaps--;
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- sharing */
static int g_export_fd_width = 4; /* bytes written through shareableHandle */

/* 4 (an int, the default) or 8 (a 64-bit value): how a driver may write the descriptor. */
void emu_set_export_fd_width(int bytes) { g_export_fd_width = bytes == 8 ? 8 : 4; }

CNresult cnDeviceGetAttribute(int *pi, CNdevice_attribute attrib, CNdev dev) {
    if (!pi) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (dev < EMU_DEVICE_TAG || dev >= EMU_DEVICE_TAG + EMU_DEVICES)
        RETURN_UNLOCK(CN_ERROR_INVALID_DEVICE);
    if (attrib != CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
        RETURN_UNLOCK(CN_OPS_ERROR_NOT_SUPPORTED); /* emulator choice: not emulated */
    *pi = 1;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemExportToShareableHandle(void *shareableHandle, CNmemGenericAllocationHandle handle,
                                      CNmemAllocationHandleType handleType, cn_uint64_t flags) {
    if (!shareableHandle || flags != 0) return CN_ERROR_INVALID_VALUE;
    if (handleType != CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    emu_handle *h = lookup_handle(handle, NULL);
    if (!h) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (!h->exportable) RETURN_UNLOCK(CN_OPS_ERROR_NOT_SUPPORTED);
    int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0); /* a new descriptor, the caller's to close */
    if (fd < 0) RETURN_UNLOCK(CN_ERROR_OPERATING_SYSTEM);
    if (g_export_fd_width == 8)
        *(uint64_t *)shareableHandle = (uint64_t)(uint32_t)fd; /* see the header comment */
    else
        *(int *)shareableHandle = fd;
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemImportFromShareableHandle(CNmemGenericAllocationHandle *handle, void *osHandle,
                                        CNmemAllocationHandleType shHandleType) {
    if (!handle || shHandleType != CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CN_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)osHandle;
    char link[64], target[128];
    unsigned dev = EMU_DEVICES;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return CN_ERROR_INVALID_VALUE; /* not an open descriptor */
    target[n] = 0;
    if (sscanf(target, "/memfd:cndrv_emu:dev%u", &dev) != 1 || dev >= EMU_DEVICES)
        return CN_ERROR_INVALID_VALUE; /* not memory exported by this driver */
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return CN_ERROR_INVALID_VALUE;
    LOCKED_INIT_CHECK();
    if (grow((void **)&g_handles, &g_caphandles, g_nhandles + 1, sizeof(emu_handle)))
        RETURN_UNLOCK(CN_ERROR_SYSTEM_OUT_OF_MEMORY);
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the caller keeps and closes its descriptor */
    if (mine < 0) RETURN_UNLOCK(CN_ERROR_OPERATING_SYSTEM);
    emu_handle *h = &g_handles[g_nhandles];
    memset(h, 0, sizeof *h);
    h->fd = mine;
    h->size = (uint64_t)st.st_size;
    h->device = dev; /* the memory stays where it was created */
    h->live = 1;
    h->exportable = 1;
    h->imported = 1;
    *handle = EMU_HANDLE_TAG + g_nhandles;
    g_nhandles++;
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- copies */
CNresult cnMemcpyHtoD(CNaddr dstAddr, const void *srcAddr, cn_uint64_t bytes) {
    LOCKED_INIT_CHECK();
    if (!context_ok()) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    if (!srcAddr && bytes) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (!range_accessible(dstAddr, bytes, 1)) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    memmove((void *)(uintptr_t)dstAddr, srcAddr, bytes);
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemcpyDtoH(void *dstAddr, CNaddr srcAddr, cn_uint64_t bytes) {
    LOCKED_INIT_CHECK();
    if (!context_ok()) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    if (!dstAddr && bytes) RETURN_UNLOCK(CN_ERROR_INVALID_VALUE);
    if (!range_accessible(srcAddr, bytes, 0)) RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    memmove(dstAddr, (const void *)(uintptr_t)srcAddr, bytes);
    RETURN_UNLOCK(CN_SUCCESS);
}

CNresult cnMemcpyDtoD(CNaddr dstAddr, CNaddr srcAddr, cn_uint64_t bytes) {
    LOCKED_INIT_CHECK();
    if (!context_ok()) RETURN_UNLOCK(CN_CONTEXT_ERROR_INVALID);
    if (!range_accessible(srcAddr, bytes, 0) || !range_accessible(dstAddr, bytes, 1))
        RETURN_UNLOCK(CN_MEMORY_ERROR_INVALID_ADDRESS);
    memmove((void *)(uintptr_t)dstAddr, (const void *)(uintptr_t)srcAddr, bytes);
    RETURN_UNLOCK(CN_SUCCESS);
}

/* ---------------------------------------------------------------- test-only queries */
int emu_is_emulated(void) { return 1; }

/* 0 sizeof(CNmemAllocationProp), 1 sizeof(CNmemAccessDesc), 2 sizeof(CNmemLocation),
 * 3 offsetof(CNmemAllocationProp, location), 4 offsetof(CNmemAllocationProp, allocFlags),
 * 5 offsetof(CNmemAccessDesc, accessFlags), 6 offsetof(CNmemAccessDesc, pinnedType) */
long emu_layout(int which) {
    switch (which) {
    case 0: return (long)sizeof(CNmemAllocationProp);
    case 1: return (long)sizeof(CNmemAccessDesc);
    case 2: return (long)sizeof(CNmemLocation);
    case 3: return (long)offsetof(CNmemAllocationProp, location);
    case 4: return (long)offsetof(CNmemAllocationProp, allocFlags);
    case 5: return (long)offsetof(CNmemAccessDesc, accessFlags);
    case 6: return (long)offsetof(CNmemAccessDesc, pinnedType);
    default: return -1;
    }
}

/* 0 live handles (not yet freed), 1 live mappings, 2 live reservations,
 * 3 frees deferred by cnMemRelease of a mapped handle, 4 successful cnMemSetAccess calls */
unsigned long long emu_count(int which) {
    unsigned long long n = 0;
    pthread_mutex_lock(&g_lock);
    switch (which) {
    case 0:
        for (size_t i = 0; i < g_nhandles; i++) n += g_handles[i].live ? 1 : 0;
        break;
    case 1: n = g_nmaps; break;
    case 2: n = g_nranges; break;
    case 3: n = g_pending_frees; break;
    case 4: n = g_set_access_calls; break;
    default: break;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Device capacity in bytes (per device); returns the previous one.  Lets tests reach
 * CN_MEMORY_ERROR_OUT_OF_MEMORY without allocating gigabytes. */
unsigned long long emu_set_capacity(unsigned long long bytes) {
    pthread_mutex_lock(&g_lock);
    unsigned long long old = g_capacity;
    g_capacity = bytes;
    pthread_mutex_unlock(&g_lock);
    return old;
}
