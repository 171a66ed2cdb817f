/*
 * How both alloc entry points (vmm_shim.c, vmm_segments.c) call their Python callback,
 * and what they do with a Ctrl-C.  Include after Python.h.
 *
 * The callback's `state` word: 0, or VMM_CB_CTRL_C_BEFORE as alloc calls it; the callback
 * sets VMM_CB_INTERRUPTED when a Ctrl-C is to be passed on.
 *
 * A SIGINT that arrives while the framework's own code runs (before it calls alloc) is
 * only noted by Python's C-level handler; Python raises it at the next bytecode, which
 * would be the callback's first: before any `try`, so ctypes would print it, drop it,
 * and leave the memory unmade (out of memory to the framework).  So alloc first runs the
 * pending signal handlers itself (PyErr_CheckSignals, with the GIL; main thread only).
 * A KeyboardInterrupt from them is cleared and told to the callback
 * (VMM_CB_CTRL_C_BEFORE), which makes the memory and passes it on when it was Python's
 * own handler's; another exception is printed and dropped, as ctypes would have, and
 * the allocation is out of memory, as when a handler raises in the callback.
 *
 * Passing a Ctrl-C on is signalling SIGINT again once the callback has returned, so that
 * Python raises it after the framework's call, not inside it (where it would become out
 * of memory).  Only to an installed handler: a SIGINT left to its default action would
 * kill the process.
 */
#ifndef VMM_INTERRUPT_H
#define VMM_INTERRUPT_H

#include <signal.h>
#include <stddef.h>

#define VMM_CB_INTERRUPTED 1
#define VMM_CB_CTRL_C_BEFORE 2

typedef void (*vmm_alloc_cb)(size_t size, int device, void *stream, void **out, int *state);

static inline void vmm_pass_on_interrupt(void) {
    struct sigaction now;
    if (sigaction(SIGINT, NULL, &now) != 0) {
        return;
    }
    if ((now.sa_flags & SA_SIGINFO) || (now.sa_handler != SIG_DFL && now.sa_handler != SIG_IGN)) {
        raise(SIGINT);
    }
}

/* The address the callback made (NULL: none, out of memory to the framework).  The GIL
 * is held from the look at the signals to the callback's return (the callback takes it
 * again, recursively): what is left is the callback's entry, where Python may still
 * switch threads or raise a signal that just came.  An error the caller had set is put
 * aside for the callback and set again after it. */
static inline void *vmm_call_alloc_cb(vmm_alloc_cb cb, size_t size, int device, void *stream) {
    void *ptr = NULL;
    int state = 0;
    if (!cb) {
        return NULL; /* none installed, or disabled at exit: Python is not touched */
    }
    if (!Py_IsInitialized()) {
        cb(size, device, stream, &ptr, &state);
        return ptr;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    int raised = 0;
    while (PyErr_CheckSignals() < 0) { /* stops at a raising handler: the rest again */
        if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            PyErr_Clear();
            state = VMM_CB_CTRL_C_BEFORE;
        } else { /* another handler's exception: out of memory, as anywhere in the call */
            PyErr_WriteUnraisable(NULL);
            raised = 1;
        }
    }
    if (!raised || state == VMM_CB_CTRL_C_BEFORE) { /* a Ctrl-C is not lost with it */
        cb(size, device, stream, &ptr, &state);
    }
    PyErr_Restore(type, value, trace);
    PyGILState_Release(gil);
    if (state == VMM_CB_INTERRUPTED) {
        vmm_pass_on_interrupt();
    }
    return ptr;
}

#endif
