/* Shared by the emulated drivers: grow a realloc'd array to hold `need` elements.
 * Returns 0, or -1 when memory runs out (the caller reports the vendor's OOM code). */
#ifndef VMM_CORE_EMU_ARRAY_H
#define VMM_CORE_EMU_ARRAY_H

#include <stdlib.h>

static inline int grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap * 2 : 16;
    while (ncap < need) ncap *= 2;
    void *p = realloc(*arr, ncap * elem);
    if (!p) return -1;
    *arr = p;
    *cap = ncap;
    return 0;
}

#endif
