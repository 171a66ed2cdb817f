/*
 * What both alloc entry points (vmm_shim.c, vmm_segments.c) do with a Ctrl-C their
 * Python callback held while it made the memory: signal SIGINT again once the callback
 * has returned, so that Python raises it after the framework's call, not inside it
 * (where it would become out of memory).  Only to an installed handler: a SIGINT left
 * to its default action would kill the process.
 */
#ifndef VMM_INTERRUPT_H
#define VMM_INTERRUPT_H

#include <signal.h>

static inline void vmm_pass_on_interrupt(void) {
    struct sigaction now;
    if (sigaction(SIGINT, NULL, &now) != 0) {
        return;
    }
    if ((now.sa_flags & SA_SIGINFO) || (now.sa_handler != SIG_DFL && now.sa_handler != SIG_IGN)) {
        raise(SIGINT);
    }
}

#endif
