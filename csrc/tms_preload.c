/*
 * The file RL launchers put in LD_PRELOAD when they switch on torch_memory_saver's
 * whole-process mode, found where they look for it: beside the `torch_memory_saver`
 * package that vmm_core's alias provides (vmm_core/integrations/tms_alias/), under
 * torch_memory_saver's file name, torch_memory_saver_hook_mode_preload.abi3.so.
 *
 * It intercepts nothing.  Loaded into a process, it does two things:
 *   - its constructor puts its own directory first on PYTHONPATH (once), so that a
 *     Python process started this way imports vmm_core's torch_memory_saver, whose
 *     sitecustomize there routes the process's framework allocations when TMS_INIT_ENABLE
 *     (with TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND,
 *     TMS_INIT_ENABLE_DISK_BACKUP, TMS_DISK_BACKUP_DIR, TMS_DISK_BACKUP_CHUNK_MB) asks;
 *   - it exports tms_pause / tms_resume, which code reaching torch_memory_saver's C
 *     symbols through the process's global namespace (ctypes.CDLL(None)) calls; they run
 *     the Python object's pause / resume (callbacks installed by it), and return -1
 *     while none is installed.  A callback writes its outcome into an int that the
 *     symbol sets to -1 first, rather than returning it: when a Python exception (Ctrl-C)
 *     escapes a ctypes callback, ctypes leaves the return value undefined, and a caller
 *     could read "done" for a pause that never ran.
 * A process that is not Python only sees PYTHONPATH grow.  No vendor or Python header
 * and no library beyond libc/libdl: it must load into any process.  Nothing exits.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define VMM_TMS_PRELOAD_ABI_VERSION 2

/* What the Python side reads when this file is preloaded (launchers grep the file for
 * the names they set before they rely on them). */
__attribute__((used)) static const char vmm_tms_preload_reads[] =
    "TMS_INIT_ENABLE TMS_INIT_ENABLE_CPU_BACKUP TMS_INIT_CPU_BACKUP_BACKEND "
    "TMS_INIT_ENABLE_DISK_BACKUP TMS_DISK_BACKUP_DIR TMS_DISK_BACKUP_CHUNK_MB "
    "TMS_RETAIN_CPU_BACKUP";

typedef void (*tms_tag_cb)(const char *tag, int *rc);

static _Atomic(tms_tag_cb) g_pause = NULL;
static _Atomic(tms_tag_cb) g_resume = NULL;

int vmm_tms_preload_abi_version(void) { return VMM_TMS_PRELOAD_ABI_VERSION; }

void vmm_tms_preload_install(tms_tag_cb pause, tms_tag_cb resume) {
    atomic_store(&g_pause, pause);
    atomic_store(&g_resume, resume);
}

/* tag NULL or "": every tag.  0 when done, -1 when it failed or nothing serves it. */
int tms_pause(const char *tag) {
    tms_tag_cb cb = atomic_load(&g_pause);
    int rc = -1;
    if (cb) {
        cb(tag, &rc);
    }
    return rc;
}

int tms_resume(const char *tag) {
    tms_tag_cb cb = atomic_load(&g_resume);
    int rc = -1;
    if (cb) {
        cb(tag, &rc);
    }
    return rc;
}

static int has_entry(const char *list, const char *entry, size_t len) {
    const char *p = list;
    while (p && *p) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, entry, len) == 0) {
            return 1;
        }
        p = end ? end + 1 : NULL;
    }
    return 0;
}

__attribute__((constructor)) static void vmm_tms_preload_init(void) {
    Dl_info info;
    if (!dladdr((void *)&vmm_tms_preload_init, &info) || !info.dli_fname) {
        return;
    }
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash) {
        return;
    }
    size_t len = (size_t)(slash - info.dli_fname);
    const char *old = getenv("PYTHONPATH");
    if (len == 0 || (old && has_entry(old, info.dli_fname, len))) {
        return;
    }
    size_t old_len = old ? strlen(old) : 0;
    char *value = malloc(len + 1 + old_len + 1);
    if (!value) {
        return;
    }
    memcpy(value, info.dli_fname, len);
    value[len] = '\0';
    if (old_len) {
        value[len] = ':';
        memcpy(value + len + 1, old, old_len + 1);
    }
    setenv("PYTHONPATH", value, 1);
    free(value);
}
