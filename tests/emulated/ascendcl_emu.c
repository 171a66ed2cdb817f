/*
 * ascendcl_emu: an emulated libascendcl.so for testing the vmm_core Ascend backend
 * on machines without Ascend hardware.  It is NOT the vendor library and nothing here
 * was checked on a real NPU.
 *
 * Why it exists: the backend talks to libascendcl through ctypes only, so a library that
 * exports the same symbols with the same C signatures, struct layouts, enum values and
 * error codes exercises exactly the code that would run against CANN.  The physical
 * memory behind a handle is a memfd, a reservation is an mmap(PROT_NONE) range, a map is
 * mmap(MAP_FIXED | MAP_SHARED) of the handle's memfd and an unmap puts the range back to
 * PROT_NONE while keeping it reserved, so two reservations mapping one handle really
 * alias, as they do on the device.
 *
 * Facts taken from the vendor's public sources (hicann/runtime, read only, no code
 * copied):
 *   include/external/acl/acl_rt.h          signatures, aclrtPhysicalMemProp layout, enums
 *   include/external/acl/acl_base_rt.h     ACL_SUCCESS, ACL_ERROR_INVALID_PARAM (100000),
 *                                          ACL_ERROR_UNINITIALIZE (100001),
 *                                          ACL_ERROR_REPEAT_INITIALIZE (100002)
 *   include/external/acl/error_codes/rt_error_codes.h
 *                                          ACL_ERROR_RT_* (107000, 107001, 107002, 107008,
 *                                          107017, 207000, 207001)
 *   src/acl/aclrt_impl/memory.cpp          which checks the ACL layer does itself (null
 *                                          pointers, size > 0, flags, handleType,
 *                                          allocationType, location type, memAttr table)
 *                                          and that they return ACL_ERROR_INVALID_PARAM
 *   docs/api_docs/aclrtMapMem.md etc.      map size == handle size, offset 0, alignment 0,
 *                                          free/release only after unmap
 * Constraints enforced below the ACL layer (in the runtime/driver, whose source is not
 * public) return the ACL_ERROR_RT_* code whose documented meaning fits: that choice is
 * the emulator's, marked "emulator choice" where it is made.
 *
 * Sharing between processes (aclrtMemExportToShareableHandle & co., see the section of
 * that name below) is emulated for real: an exported handle is a 64-bit value naming a
 * small record file (owner pid, the memfd's descriptor number, size, allow-list) in
 * $ASCENDCL_EMU_SHARE_DIR (default /tmp); an importer checks the allow-list and opens
 * /proc/<owner>/fd/<n>, which reopens the exporter's memfd, so the two processes map the
 * same pages.  That needs the importer to be allowed to read the exporter's /proc entry
 * (same user), as it is for the test-suite's rank processes.
 *
 * Usage rules of the CANN runtime API documents (hiascend.com, "aclcppdevg" pages of the
 * runtime API reference, chapter "virtual memory management"; page ids below) enforced
 * here, each marked "doc rule" where it is checked:
 *   R1 aclrtMapMem (aclcppdevg_03_0116, CANN 8.5.0 / 9.0.0, parameter "handle"): a reservation
 *      the user partitions may not be bound to physical memory of two devices at once, nor
 *      to handles of aclrtMallocPhysical and of aclrtMemImportFromShareableHandle at once.
 *   R2 aclrtMemImportFromShareableHandle (aclcppdevg_03_0121, CANN 8.0.0, "Restrictions"):
 *      export and import are not supported in one process, only across processes.  Read
 *      here as: a process may not import a value it exported itself.  The sentence could
 *      also mean that a process that exported anything may import nothing; no hardware was
 *      at hand to tell, and that stricter reading would forbid every two-way exchange.
 *   R3 aclrtMemSetAccess (aclcppdevg_03_2044, CANN 8.5.0): virPtr and size must equal those
 *      of one aclrtMapMem call.
 *   R4 aclrtFreePhysical (aclcppdevg_03_0113, CANN 9.0.0, "Function"): freeing a mapped
 *      handle succeeds; the memory is really freed at the last aclrtUnmapMem.  (Older pages,
 *      e.g. CANN 8.0.RC2 aclcppdevg_03_0110, said "unmap first"; the current text wins.)
 *   R5 aclrtMemExportToShareableHandle(V2) (runtime docs/api_docs/
 *      aclrtMemExportToShareableHandleV2.md, parameter "handle"; the V1 import page
 *      aclcppdevg_03_0121 states the same one-to-one rule): handle and shareableHandle are
 *      one-to-one in a process, exporting the same handle again returns an error; the
 *      import page (aclcppdevg_03_0121, "Restrictions") adds that importing the same value
 *      again in one process returns an error too (enforced while the first import lives).
 *   R6 cross-device sharing needs aclrtDeviceEnablePeerAccess (aclcppdevg_03_0121 and the
 *      export page aclcppdevg_03_0115, CANN 8.0.RC2, "Restrictions"; acl_rt.h line 3021:
 *      aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags), flags must be 0,
 *      peer != current device, aclcppdevg_03_0052): importing memory of device P for
 *      device D needs D -> P enabled first.
 * The documents name no error code for R1-R3, R5, R6; the codes returned are the
 * emulator's choice (marked so).
 *
 * Contract with the test-suite: never exits or aborts; every failure is an error code.
 * Test-only query symbols carry the emu_ prefix.
 * Build: cc -shared -fPIC -O1 -Wall -Werror -std=gnu11
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "emu_array.h"

/* ------------------------------------------------------------------ vendor types */
typedef int aclError;
typedef void *aclrtDrvMemHandle;

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEFAULT,
    ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE,
    ACL_MEMCPY_INTER_DEVICE_TO_DEVICE,
} aclrtMemcpyKind;

typedef enum aclrtMemAttr {
    ACL_DDR_MEM,
    ACL_HBM_MEM,
    ACL_DDR_MEM_HUGE,
    ACL_DDR_MEM_NORMAL,
    ACL_HBM_MEM_HUGE,
    ACL_HBM_MEM_NORMAL,
    ACL_DDR_MEM_P2P_HUGE,
    ACL_DDR_MEM_P2P_NORMAL,
    ACL_HBM_MEM_P2P_HUGE,
    ACL_HBM_MEM_P2P_NORMAL,
    ACL_HBM_MEM_HUGE1G,
    ACL_HBM_MEM_P2P_HUGE1G,
    ACL_MEM_NORMAL, /* 12..17 appear from acl_rt.h 1.17 on */
    ACL_MEM_HUGE,
    ACL_MEM_HUGE1G,
    ACL_MEM_P2P_NORMAL,
    ACL_MEM_P2P_HUGE,
    ACL_MEM_P2P_HUGE1G,
} aclrtMemAttr;

typedef enum aclrtMemLocationType {
    ACL_MEM_LOCATION_TYPE_HOST = 0,
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEM_LOCATION_TYPE_UNREGISTERED,
    ACL_MEM_LOCATION_TYPE_MANAGED,
    ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4,
} aclrtMemLocationType;

typedef struct aclrtMemLocation {
    uint32_t id;
    aclrtMemLocationType type;
} aclrtMemLocation;

typedef enum aclrtMemAllocationType {
    ACL_MEM_ALLOCATION_TYPE_PINNED = 0,
} aclrtMemAllocationType;

typedef enum aclrtMemHandleType {
    ACL_MEM_HANDLE_TYPE_NONE = 0,
    ACL_MEM_HANDLE_TYPE_POSIX = 2,
} aclrtMemHandleType;

typedef struct aclrtPhysicalMemProp {
    aclrtMemHandleType handleType;
    aclrtMemAllocationType allocationType;
    aclrtMemAttr memAttr;
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

typedef enum aclrtMemGranularityOptions {
    ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
    ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF = 0xFFFF,
} aclrtMemGranularityOptions;

/* ------------------------------------------------------------------ vendor codes */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_ADDR_UNALIGNED 107008
#define ACL_ERROR_RT_INVALID_HANDLE 107017
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_NO_PERMISSION 207006

/* acl_rt.h: export flags, access flags and descriptor */
#define ACL_RT_VMM_EXPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL

typedef enum {
    ACL_RT_MEM_ACCESS_FLAGS_NONE = 0x0,
    ACL_RT_MEM_ACCESS_FLAGS_READ = 0x1,
    ACL_RT_MEM_ACCESS_FLAGS_READWRITE = 0x3,
} aclrtMemAccessFlags;

typedef struct {
    aclrtMemAccessFlags flags;
    aclrtMemLocation location;
    uint8_t rsv[12];
} aclrtMemAccessDesc;

/* ------------------------------------------------------------------ emulator state */
#define EMU_GRANULARITY ((size_t)2 << 20) /* 2 MiB huge pages, like ACL_HBM_MEM_HUGE */
#define EMU_DEVICE_COUNT 2
#define EMU_HANDLE_MAGIC 0x41434c48u

struct emu_handle {
    uint32_t magic;
    int fd;
    size_t size;
    int32_t device;
    int maps;        /* live mappings of this handle */
    int imported;    /* made by aclrtMemImportFromShareableHandle: not this device's memory */
    uint64_t shared; /* value returned by aclrtMemExportToShareableHandle, 0 if none */
    int32_t origin;  /* device whose physical memory this is (the exporter's, if imported) */
    int freed;       /* aclrtFreePhysical called while mapped: freed at the last unmap (R4) */
    uint64_t source; /* the shareable value it was imported from (0 if made here), R5 */
};

struct emu_range {
    uintptr_t base;
    size_t size;
    int32_t device;
};

struct emu_map {
    uintptr_t addr;
    size_t size;
    struct emu_handle *handle;
    int prot; /* PROT_* set by aclrtMapMem (read-write) or aclrtMemSetAccess */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized = 0;
static __thread int32_t t_device = -1; /* aclrtSetDevice is per thread, as in ACL */
static size_t g_limit = (size_t)32 << 30; /* emulated HBM per device */
static size_t g_used[EMU_DEVICE_COUNT];
/* R6: g_peer[d][p] is set once aclrtDeviceEnablePeerAccess(p) ran with d current */
static int g_peer[EMU_DEVICE_COUNT][EMU_DEVICE_COUNT];
static size_t g_peer_calls;

static struct emu_handle **g_handles;
static size_t g_nhandles, g_caphandles;
static struct emu_range *g_ranges;
static size_t g_nranges, g_capranges;
static struct emu_map *g_maps;
static size_t g_nmaps, g_capmaps;

static void forget_share(uint64_t value); /* sharing section, below */

/* Every memory call needs aclInit and a device set on the calling thread. */
static aclError need_context(void) {
    if (!g_initialized) return ACL_ERROR_UNINITIALIZE;
    if (t_device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    return ACL_SUCCESS;
}

static long find_handle(const void *h) {
    for (size_t i = 0; i < g_nhandles; i++)
        if ((const void *)g_handles[i] == h) return (long)i;
    return -1;
}

static long find_range_containing(uintptr_t a, size_t n) {
    for (size_t i = 0; i < g_nranges; i++)
        if (g_ranges[i].base <= a && a + n <= g_ranges[i].base + g_ranges[i].size &&
            a + n >= a)
            return (long)i;
    return -1;
}

static long find_map_containing(uintptr_t a) {
    for (size_t i = 0; i < g_nmaps; i++)
        if (g_maps[i].addr <= a && a < g_maps[i].addr + g_maps[i].size) return (long)i;
    return -1;
}

static int is_device_address(uintptr_t a) { return find_range_containing(a, 1) >= 0; }

/* [a, a+n) is covered by live mappings (possibly several adjacent ones) whose access
 * includes `prot`. */
static int mapped_with(uintptr_t a, size_t n, int prot) {
    uintptr_t cur = a, end = a + n;
    if (end < a) return 0;
    while (cur < end) {
        long m = find_map_containing(cur);
        if (m < 0 || (g_maps[m].prot & prot) != prot) return 0;
        cur = g_maps[m].addr + g_maps[m].size;
    }
    return 1;
}

/* The ACL layer's prop checks (memory.cpp), then what the emulator supports. */
static aclError check_prop(const aclrtPhysicalMemProp *prop) {
    if (prop->handleType != ACL_MEM_HANDLE_TYPE_NONE) return ACL_ERROR_INVALID_PARAM;
    if (prop->allocationType != ACL_MEM_ALLOCATION_TYPE_PINNED) return ACL_ERROR_INVALID_PARAM;
    if (prop->location.type != ACL_MEM_LOCATION_TYPE_DEVICE) {
        /* UNREGISTERED / MANAGED / unknown are invalid in ACL; HOST and HOST_NUMA are
         * valid there but host-side physical memory is not emulated (emulator choice). */
        if (prop->location.type == ACL_MEM_LOCATION_TYPE_HOST ||
            prop->location.type == ACL_MEM_LOCATION_TYPE_HOST_NUMA)
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        return ACL_ERROR_INVALID_PARAM;
    }
    switch ((int)prop->memAttr) {
    case ACL_HBM_MEM_HUGE:
    case ACL_HBM_MEM_NORMAL:
    case ACL_MEM_NORMAL:
    case ACL_MEM_HUGE:
    case ACL_MEM_P2P_NORMAL:
    case ACL_MEM_P2P_HUGE:
        break;
    case ACL_HBM_MEM_HUGE1G:
    case ACL_MEM_HUGE1G:
    case ACL_MEM_P2P_HUGE1G:
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* 1 GiB pages: emulator choice */
    default: /* DDR_* on a device, or not in ACL's memAttr table */
        return ACL_ERROR_INVALID_PARAM;
    }
    if (prop->location.id >= EMU_DEVICE_COUNT) return ACL_ERROR_RT_INVALID_DEVICEID;
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------ device management */
aclError aclInit(const char *configPath) {
    (void)configPath;
    aclError rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_initialized)
        rc = ACL_ERROR_REPEAT_INITIALIZE;
    else
        g_initialized = 1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

aclError aclrtGetDeviceCount(uint32_t *count) {
    if (!g_initialized) return ACL_ERROR_UNINITIALIZE;
    if (!count) return ACL_ERROR_INVALID_PARAM;
    *count = EMU_DEVICE_COUNT;
    return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t deviceId) {
    if (!g_initialized) return ACL_ERROR_UNINITIALIZE;
    if (deviceId < 0 || deviceId >= EMU_DEVICE_COUNT) return ACL_ERROR_RT_INVALID_DEVICEID;
    t_device = deviceId;
    return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t *deviceId) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!deviceId) return ACL_ERROR_INVALID_PARAM;
    *deviceId = t_device;
    return ACL_SUCCESS;
}

aclError aclrtSynchronizeDevice(void) { return need_context(); }

aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                          aclrtMemGranularityOptions option,
                                          size_t *granularity) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!prop || !granularity) return ACL_ERROR_INVALID_PARAM;
    rc = check_prop(prop);
    if (rc) return rc;
    if (option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM &&
        option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return ACL_ERROR_INVALID_PARAM;
    *granularity = EMU_GRANULARITY;
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------ virtual ranges */
aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                uint64_t flags) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!virPtr || size == 0) return ACL_ERROR_INVALID_PARAM;
    if (flags != 0 && flags != 1) return ACL_ERROR_INVALID_PARAM; /* 1 kept for compat */
    if (alignment != 0) return ACL_ERROR_INVALID_PARAM;           /* reserved: must be 0 */
    if (expectPtr != NULL) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* experimental in CANN */
    if (size % EMU_GRANULARITY) return ACL_ERROR_RT_PARAM_INVALID;
    size_t total = size + EMU_GRANULARITY;
    if (total < size) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    void *raw = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    uintptr_t base = ((uintptr_t)raw + EMU_GRANULARITY - 1) & ~(uintptr_t)(EMU_GRANULARITY - 1);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    uintptr_t tail = (uintptr_t)raw + total - (base + size);
    if (tail) munmap((void *)(base + size), tail);
    pthread_mutex_lock(&g_lock);
    if (grow((void **)&g_ranges, &g_capranges, g_nranges + 1, sizeof *g_ranges)) {
        pthread_mutex_unlock(&g_lock);
        munmap((void *)base, size);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    g_ranges[g_nranges++] = (struct emu_range){base, size, t_device};
    pthread_mutex_unlock(&g_lock);
    *virPtr = (void *)base;
    return ACL_SUCCESS;
}

aclError aclrtReleaseMemAddress(void *virPtr) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!virPtr) return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&g_lock);
    long r = -1;
    for (size_t i = 0; i < g_nranges; i++)
        if (g_ranges[i].base == (uintptr_t)virPtr) r = (long)i;
    if (r < 0) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* not the start of a reservation */
    } else {
        struct emu_range range = g_ranges[r];
        for (size_t i = 0; i < g_nmaps; i++)
            if (range.base <= g_maps[i].addr && g_maps[i].addr < range.base + range.size)
                rc = ACL_ERROR_RT_PARAM_INVALID; /* still mapped: unmap first */
        if (!rc) {
            munmap((void *)range.base, range.size);
            g_ranges[r] = g_ranges[--g_nranges];
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ physical memory */
static size_t g_deferred; /* handles freed while mapped, waiting for their last unmap */

/* Gives a handle's memory back (g_lock held). */
static void destroy_handle(struct emu_handle *h) {
    if (h->freed) g_deferred--;
    if (!h->imported) g_used[h->device] -= h->size;
    if (h->shared) forget_share(h->shared);
    close(h->fd);
    h->magic = 0;
    free(h);
}

aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                             const aclrtPhysicalMemProp *prop, uint64_t flags) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!handle || !prop || size == 0 || flags != 0) return ACL_ERROR_INVALID_PARAM;
    rc = check_prop(prop);
    if (rc) return rc;
    if (size % EMU_GRANULARITY) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t dev = (int32_t)prop->location.id;
    pthread_mutex_lock(&g_lock);
    if (g_used[dev] + size > g_limit || g_used[dev] + size < size) {
        pthread_mutex_unlock(&g_lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    int fd = memfd_create("ascendcl_emu", MFD_CLOEXEC);
    struct emu_handle *h = fd >= 0 ? calloc(1, sizeof *h) : NULL;
    if (fd < 0 || !h || ftruncate(fd, (off_t)size) != 0 ||
        grow((void **)&g_handles, &g_caphandles, g_nhandles + 1, sizeof *g_handles)) {
        if (fd >= 0) close(fd);
        free(h);
        pthread_mutex_unlock(&g_lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    *h = (struct emu_handle){EMU_HANDLE_MAGIC, fd, size, dev, 0, 0, 0, dev, 0};
    g_handles[g_nhandles++] = h;
    g_used[dev] += size;
    pthread_mutex_unlock(&g_lock);
    *handle = h;
    return ACL_SUCCESS;
}

aclError aclrtFreePhysical(aclrtDrvMemHandle handle) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!handle) return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&g_lock);
    long i = find_handle(handle);
    if (i < 0) {
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    } else {
        struct emu_handle *h = g_handles[i];
        g_handles[i] = g_handles[--g_nhandles]; /* the handle is dead to the caller now */
        if (h->maps > 0) {
            h->freed = 1, g_deferred++; /* doc rule R4: the memory goes at the last unmap */
            /* ... but the handle is gone now, and with it its shareable value: an import
             * needs memory "not released in advance" (aclcppdevg_03_0121, Restrictions) */
            if (h->shared) forget_share(h->shared), h->shared = 0;
        } else
            destroy_handle(h);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ mapping */
aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                     uint64_t flags) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!virPtr || !handle || size == 0 || flags != 0) return ACL_ERROR_INVALID_PARAM;
    uintptr_t a = (uintptr_t)virPtr;
    pthread_mutex_lock(&g_lock);
    long hi = find_handle(handle);
    long r = find_range_containing(a, size);
    if (hi < 0) {
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    } else if (a % EMU_GRANULARITY) {
        rc = ACL_ERROR_RT_ADDR_UNALIGNED;
    } else if (size % EMU_GRANULARITY || offset != 0 || size != g_handles[hi]->size) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* one map covers one whole handle at offset 0 */
    } else if (r < 0 || g_ranges[r].device != g_handles[hi]->device) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* outside a reservation, or another device's */
    } else {
        struct emu_handle *h = g_handles[hi];
        struct emu_range range = g_ranges[r];
        for (size_t i = 0; i < g_nmaps; i++) {
            if (g_maps[i].addr < a + size && a < g_maps[i].addr + g_maps[i].size)
                rc = ACL_ERROR_RT_PARAM_INVALID; /* overlaps a live mapping */
            /* doc rule R1: one reservation holds handles of one origin only (emulator
             * choice of code: ACL_ERROR_RT_PARAM_INVALID) */
            if (range.base <= g_maps[i].addr && g_maps[i].addr < range.base + range.size &&
                (g_maps[i].handle->imported != h->imported ||
                 g_maps[i].handle->origin != h->origin))
                rc = ACL_ERROR_RT_PARAM_INVALID;
        }
    }
    if (!rc && grow((void **)&g_maps, &g_capmaps, g_nmaps + 1, sizeof *g_maps))
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (!rc) {
        struct emu_handle *h = g_handles[hi];
        void *got = mmap(virPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd, 0);
        if (got != virPtr) {
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        } else {
            g_maps[g_nmaps++] = (struct emu_map){a, size, h, PROT_READ | PROT_WRITE};
            h->maps++;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

aclError aclrtUnmapMem(void *virPtr) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!virPtr) return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&g_lock);
    long m = -1;
    for (size_t i = 0; i < g_nmaps; i++)
        if (g_maps[i].addr == (uintptr_t)virPtr) m = (long)i;
    if (m < 0) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* not the start of a mapping */
    } else {
        struct emu_map map = g_maps[m];
        void *got = mmap(virPtr, map.size, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        if (got != virPtr) {
            rc = ACL_ERROR_RT_PARAM_INVALID;
        } else {
            map.handle->maps--;
            g_maps[m] = g_maps[--g_nmaps];
            if (map.handle->freed && map.handle->maps == 0) destroy_handle(map.handle);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ sharing
 * acl_rt.h (hicann/runtime 681ef7610df1): aclrtMemExportToShareableHandle,
 * aclrtMemImportFromShareableHandle, aclrtMemSetPidToShareableHandle,
 * aclrtDeviceGetBareTgid, aclrtMemSetAccess.  The ACL layer's checks
 * (src/acl/aclrt_impl/memory.cpp) return ACL_ERROR_INVALID_PARAM: null pointers,
 * handleType != ACL_MEM_HANDLE_TYPE_NONE on export, pidNum == 0.  The allow-list refusal
 * happens in the (closed) driver; the runtime maps its DRV_ERROR_OPER_NOT_PERMITTED to
 * ACL_ERROR_RT_NO_PERMISSION (errcode_manage.cc), which is what the emulator returns. */
#define EMU_SHARE_MAGIC 0x53484152u
#define EMU_MAX_PIDS 65535 /* ascend_hal_base.h: "the maximum number of PIDs ... is 65535" */

struct share_record {
    uint32_t magic;
    int32_t owner; /* exporting process */
    int32_t fd;    /* the memfd's descriptor number in the exporter */
    int32_t device;
    uint64_t size;
    uint32_t validate; /* 0 with ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION */
    uint32_t npids;    /* followed by npids int32_t */
};

static uint32_t g_share_counter;

static void share_path(uint64_t value, char *out, size_t n) {
    const char *dir = getenv("ASCENDCL_EMU_SHARE_DIR");
    snprintf(out, n, "%s/ascendcl_emu_share_%016llx", dir && *dir ? dir : "/tmp",
             (unsigned long long)value);
}

/* Reads a record and its allow-list (*pids malloc'ed, caller frees).  0 or -1. */
static int read_share(uint64_t value, struct share_record *rec, int32_t **pids) {
    char path[512];
    share_path(value, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int ok = read(fd, rec, sizeof *rec) == (ssize_t)sizeof *rec && rec->magic == EMU_SHARE_MAGIC;
    *pids = NULL;
    if (ok && rec->npids) {
        *pids = malloc(rec->npids * sizeof(int32_t));
        ok = *pids && read(fd, *pids, rec->npids * sizeof(int32_t)) ==
                          (ssize_t)(rec->npids * sizeof(int32_t));
    }
    close(fd);
    if (!ok) {
        free(*pids);
        *pids = NULL;
        return -1;
    }
    return 0;
}

/* Writes a record atomically (temporary file + rename). */
static int write_share(uint64_t value, const struct share_record *rec, const int32_t *pids) {
    char path[512], tmp[540];
    share_path(value, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    int ok = write(fd, rec, sizeof *rec) == (ssize_t)sizeof *rec &&
             (!rec->npids || write(fd, pids, rec->npids * sizeof(int32_t)) ==
                                 (ssize_t)(rec->npids * sizeof(int32_t)));
    close(fd);
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static void forget_share(uint64_t value) {
    char path[512];
    share_path(value, path, sizeof path);
    unlink(path);
}

aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType handleType,
                                         uint64_t flags, uint64_t *shareableHandle) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!handle || !shareableHandle || handleType != ACL_MEM_HANDLE_TYPE_NONE)
        return ACL_ERROR_INVALID_PARAM;
    if (flags != ACL_RT_VMM_EXPORT_FLAG_DEFAULT &&
        flags != ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return ACL_ERROR_INVALID_PARAM; /* emulator choice */
    pthread_mutex_lock(&g_lock);
    long i = find_handle(handle);
    if (i < 0) {
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    } else if (g_handles[i]->imported) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* "the handle that created by the process itself" */
    } else if (g_handles[i]->shared) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* doc rule R5: exported already (code: emulator
                                          * choice) */
    } else {
        struct emu_handle *h = g_handles[i];
        uint64_t value = ((uint64_t)(uint32_t)getpid() << 32) | ++g_share_counter;
        struct share_record rec = {EMU_SHARE_MAGIC, (int32_t)getpid(), h->fd, h->device,
                                   h->size, flags != ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
                                   0};
        if (write_share(value, &rec, NULL) != 0) {
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        } else {
            h->shared = value;
            *shareableHandle = value;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!pid || pidNum == 0) return ACL_ERROR_INVALID_PARAM;
    if (pidNum > EMU_MAX_PIDS) return ACL_ERROR_RT_PARAM_INVALID;
    struct share_record rec;
    int32_t *old = NULL;
    pthread_mutex_lock(&g_lock);
    if (read_share(shareableHandle, &rec, &old) != 0) {
        rc = ACL_ERROR_RT_INVALID_HANDLE; /* never exported, or freed */
    } else if (rec.owner != (int32_t)getpid()) {
        rc = ACL_ERROR_RT_NO_PERMISSION; /* only the exporting process sets the list */
    } else if (rec.npids + pidNum > EMU_MAX_PIDS) {
        rc = ACL_ERROR_RT_PARAM_INVALID;
    } else {
        int32_t *all = malloc((rec.npids + pidNum) * sizeof(int32_t));
        if (!all) {
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        } else {
            if (rec.npids) memcpy(all, old, rec.npids * sizeof(int32_t));
            memcpy(all + rec.npids, pid, pidNum * sizeof(int32_t));
            rec.npids += (uint32_t)pidNum;
            if (write_share(shareableHandle, &rec, all) != 0) rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            free(all);
        }
    }
    pthread_mutex_unlock(&g_lock);
    free(old);
    return rc;
}

aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
                                           aclrtDrvMemHandle *handle) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!handle) return ACL_ERROR_INVALID_PARAM;
    if (deviceId < 0 || deviceId >= EMU_DEVICE_COUNT) return ACL_ERROR_RT_INVALID_DEVICEID;
    struct share_record rec;
    int32_t *pids = NULL;
    if (read_share(shareableHandle, &rec, &pids) != 0) return ACL_ERROR_RT_INVALID_HANDLE;
    if (rec.owner == (int32_t)getpid()) {
        free(pids);
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* doc rule R2 (code: emulator choice) */
    }
    if (rec.device != deviceId && !g_peer[deviceId][rec.device]) {
        free(pids);
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* doc rule R6 (code: emulator choice) */
    }
    int allowed = !rec.validate;
    for (uint32_t k = 0; k < rec.npids && !allowed; k++)
        allowed = pids[k] == (int32_t)getpid();
    free(pids);
    if (!allowed) return ACL_ERROR_RT_NO_PERMISSION;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)rec.owner, (int)rec.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC); /* the exporter's memfd, shared pages */
    struct stat st;
    if (fd < 0) return ACL_ERROR_RT_INVALID_HANDLE; /* its exporter exited */
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != rec.size) {
        close(fd);
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nhandles; i++) {
        if (g_handles[i]->imported && g_handles[i]->source == shareableHandle) {
            close(fd);
            pthread_mutex_unlock(&g_lock);
            return ACL_ERROR_RT_PARAM_INVALID; /* doc rule R5, import side: this process
                                                * imported the value already (code:
                                                * emulator choice) */
        }
    }
    struct emu_handle *h = calloc(1, sizeof *h);
    if (!h || grow((void **)&g_handles, &g_caphandles, g_nhandles + 1, sizeof *g_handles)) {
        free(h);
        close(fd);
        pthread_mutex_unlock(&g_lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    *h = (struct emu_handle){EMU_HANDLE_MAGIC, fd, (size_t)rec.size, deviceId, 0, 1, 0,
                             rec.device, 0, shareableHandle};
    g_handles[g_nhandles++] = h;
    pthread_mutex_unlock(&g_lock);
    *handle = h;
    return ACL_SUCCESS;
}

aclError aclrtDeviceGetBareTgid(int32_t *pid) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!pid) return ACL_ERROR_INVALID_PARAM;
    *pid = (int32_t)getpid(); /* no container here: the host pid is the process's pid */
    return ACL_SUCCESS;
}

aclError aclrtMemSetAccess(void *virPtr, size_t size, aclrtMemAccessDesc *desc, size_t count) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!virPtr || !desc || size == 0 || count == 0) return ACL_ERROR_INVALID_PARAM;
    int prot = PROT_NONE;
    for (size_t k = 0; k < count; k++) {
        if (desc[k].location.type == ACL_MEM_LOCATION_TYPE_HOST)
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* host access: not emulated */
        if (desc[k].location.type != ACL_MEM_LOCATION_TYPE_DEVICE) return ACL_ERROR_INVALID_PARAM;
        if (desc[k].location.id >= EMU_DEVICE_COUNT) return ACL_ERROR_RT_INVALID_DEVICEID;
        switch (desc[k].flags) {
        case ACL_RT_MEM_ACCESS_FLAGS_NONE: break;
        case ACL_RT_MEM_ACCESS_FLAGS_READ: prot |= PROT_READ; break;
        case ACL_RT_MEM_ACCESS_FLAGS_READWRITE: prot |= PROT_READ | PROT_WRITE; break;
        default: return ACL_ERROR_INVALID_PARAM;
        }
    }
    uintptr_t a = (uintptr_t)virPtr;
    pthread_mutex_lock(&g_lock);
    long m = find_map_containing(a);
    if (m < 0 || g_maps[m].addr != a || g_maps[m].size != size) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* doc rule R3: exactly one aclrtMapMem range */
    } else if (mprotect(virPtr, size, prot) != 0) {
        rc = ACL_ERROR_RT_PARAM_INVALID;
    } else {
        g_maps[m].prot = prot; /* one emulated page table serves every device */
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ peer access (R6)
 * acl_rt.h: aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId,
 * int32_t peerDeviceId); aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags)
 * "enables access between the current device and the given one; device level"; peer must
 * differ from the current device, flags "reserved, must be 0" (aclcppdevg_03_0052).  The
 * documents do not say whether enabling twice is an error: the emulator accepts it and
 * counts calls so a test can see the backend calls it once per pair. */
aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId,
                                  int32_t peerDeviceId) {
    aclError rc = need_context();
    if (rc) return rc;
    if (!canAccessPeer) return ACL_ERROR_INVALID_PARAM;
    if (deviceId < 0 || deviceId >= EMU_DEVICE_COUNT || peerDeviceId < 0 ||
        peerDeviceId >= EMU_DEVICE_COUNT)
        return ACL_ERROR_RT_INVALID_DEVICEID;
    *canAccessPeer = deviceId != peerDeviceId; /* every emulated pair is linked */
    return ACL_SUCCESS;
}

aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags) {
    aclError rc = need_context();
    if (rc) return rc;
    if (flags != 0) return ACL_ERROR_INVALID_PARAM;
    if (peerDeviceId < 0 || peerDeviceId >= EMU_DEVICE_COUNT) return ACL_ERROR_RT_INVALID_DEVICEID;
    if (peerDeviceId == t_device) return ACL_ERROR_INVALID_PARAM; /* "cannot be the current" */
    pthread_mutex_lock(&g_lock);
    g_peer[t_device][peerDeviceId] = 1;
    g_peer_calls++;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------ copies */
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind) {
    aclError rc = need_context();
    if (rc) return rc;
    if (count == 0) return ACL_SUCCESS; /* as memory.cpp: nothing to copy */
    if (!dst || !src) return ACL_ERROR_INVALID_PARAM;
    if ((int)kind < 0 || kind > ACL_MEMCPY_INTER_DEVICE_TO_DEVICE) return ACL_ERROR_INVALID_PARAM;
    if (kind > ACL_MEMCPY_DEFAULT) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* emulator choice */
    if (count > destMax) return ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&g_lock);
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    int d_dev = is_device_address(d), s_dev = is_device_address(s);
    int want_d = -1, want_s = -1;
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: want_d = 0; want_s = 0; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: want_d = 1; want_s = 0; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: want_d = 0; want_s = 1; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: want_d = 1; want_s = 1; break;
    default: break; /* ACL_MEMCPY_DEFAULT infers the direction */
    }
    if ((want_d >= 0 && want_d != d_dev) || (want_s >= 0 && want_s != s_dev))
        rc = ACL_ERROR_RT_PARAM_INVALID; /* kind does not match the addresses */
    else if ((d_dev && !mapped_with(d, count, PROT_READ | PROT_WRITE)) ||
             (s_dev && !mapped_with(s, count, PROT_READ)))
        rc = ACL_ERROR_RT_PARAM_INVALID; /* not mapped, or no access: a fault on hardware */
    else
        memmove(dst, src, count);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ test-only queries */
size_t emu_live_handles(void) { return g_nhandles; }
size_t emu_deferred_frees(void) { return g_deferred; }
size_t emu_peer_enable_calls(void) { return g_peer_calls; }
size_t emu_live_mappings(void) { return g_nmaps; }
size_t emu_live_reservations(void) { return g_nranges; }
size_t emu_granularity(void) { return EMU_GRANULARITY; }

size_t emu_physical_bytes(int32_t device) {
    return device >= 0 && device < EMU_DEVICE_COUNT ? g_used[device] : 0;
}

/* Emulated device memory per device; lower it to provoke out-of-memory. */
void emu_set_memory_limit(size_t bytes) { g_limit = bytes; }

/* 0 sizeof(prop), 1 offsetof(location), 2 offsetof(reserve), 3 sizeof(location),
 * 4 offsetof(memAttr): lets tests compare the ctypes layout with the C one. */
size_t emu_prop_layout(int which) {
    switch (which) {
    case 0: return sizeof(aclrtPhysicalMemProp);
    case 1: return offsetof(aclrtPhysicalMemProp, location);
    case 2: return offsetof(aclrtPhysicalMemProp, reserve);
    case 3: return sizeof(aclrtMemLocation);
    case 4: return offsetof(aclrtPhysicalMemProp, memAttr);
    default: return 0;
    }
}
