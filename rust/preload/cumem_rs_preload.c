/*
 * cumem_rs's preload hook: an LD_PRELOAD library that defines the CUDA runtime's cudaMalloc and cudaFree, and
 * watches its other allocators (cudaMallocAsync, cudaFreeAsync, cudaMallocManaged).
 *
 * It holds no allocator of its own. Until the cumem_rs extension is imported and registers its hooks
 * (cumem_rs_preload_register), every call goes to the real runtime; afterwards the extension decides per call
 * whether an allocation is its own (a region active on the calling thread, or TMS_INIT_ENABLE=1) and frees only
 * pointers it handed out. Everything else is forwarded, found with dlsym(RTLD_NEXT, ...) at the first call, so a
 * process that never pauses runs as without this library: cudaFree(0) (context creation), pointers from before
 * the extension was imported and pointers that are not ours reach the real runtime unchanged.
 *
 * cudaMallocAsync and cudaMallocManaged are never ours: they are forwarded, and each successful one is reported to
 * the extension (which warns once per call name and counts calls and bytes where routing was on, since that
 * memory cannot be paused). cudaFreeAsync of a pointer of ours frees it through the extension (which waits for
 * the device's work on it before the unmap); any other is forwarded and reported.
 *
 * Plain C99 with GCC/Clang atomic builtins and dlfcn: no CUDA headers (the two prototypes are declared here),
 * no Python, no locks. The hooks never synchronize anything themselves; whether a free may wait for the device
 * (never during CUDA-graph capture) is the engine's decision.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

/* cudaError_t values used here (driver_types.h). */
#define CUDA_SUCCESS_ 0
#define CUDA_ERROR_INITIALIZATION_ 3 /* no CUDA runtime in the process to forward to */

/* What current_device returns when the process has no cudaGetDevice to ask: the extension then fails the
 * allocation (with a recorded message) rather than guess a device. */
#define CUMEM_RS_NO_GET_DEVICE (-2)

/* What a hook returns for a call that is not the extension's: forward it to the real runtime. */
#define CUMEM_RS_NOT_OURS (-1)

/* The ABI between this library and the extension; bumped on any change to struct cumem_rs_preload_hooks. */
#define CUMEM_RS_PRELOAD_ABI 2u

typedef int (*cumem_rs_device_fn)(int *device);

struct cumem_rs_preload_hooks {
    unsigned abi;
    /* Allocate `size` bytes into *ptr on the current device (asked through `current_device` only when the
     * allocation is ours); returns CUMEM_RS_NOT_OURS or a cudaError_t. */
    int (*malloc_hook)(void **ptr, size_t size, cumem_rs_device_fn current_device);
    /* Free `ptr` if the extension handed it out; returns CUMEM_RS_NOT_OURS or a cudaError_t. */
    int (*free_hook)(void *ptr);
    /* Pause / resume one tag (NULL or "": every tag); returns a cudaError_t. */
    int (*pause_hook)(const char *tag);
    int (*resume_hook)(const char *tag);
    /* A successful call of one of the runtime's other allocators, already forwarded: `call` names it, `size` is
     * its bytes (0 for a free). Only counted and logged; it changes nothing. */
    void (*unrouted_hook)(const char *call, size_t size);
};

/* Declared here rather than taken from cuda_runtime_api.h: no CUDA headers at build time. */
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int cudaMallocAsync(void **ptr, size_t size, void *stream);
int cudaFreeAsync(void *ptr, void *stream);
int cudaMallocManaged(void **ptr, size_t size, unsigned int flags);
int cumem_rs_preload_current_device(int *device);
int tms_pause(const char *tag);
int tms_resume(const char *tag);
int cumem_rs_preload_register(const struct cumem_rs_preload_hooks *hooks);
unsigned cumem_rs_preload_abi(void);

/* One atomic slot: the extension's hooks (static storage in the extension, never freed), or NULL. */
static const struct cumem_rs_preload_hooks *hooks_slot;

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*get_device_fn)(int *);
typedef int (*malloc_async_fn)(void **, size_t, void *);
typedef int (*free_async_fn)(void *, void *);
typedef int (*malloc_managed_fn)(void **, size_t, unsigned int);

static void *real_malloc_slot;
static void *real_free_slot;
static void *real_get_device_slot;
static void *real_malloc_async_slot;
static void *real_free_async_slot;
static void *real_malloc_managed_slot;

/* The next definition of `name` after this library (the real runtime), cached once found. A runtime loaded
 * later (torch loads libcudart after process start) is found by a later call: NULL is not cached. */
static void *real(void **slot, const char *name) {
    void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (fn == NULL) {
        fn = dlsym(RTLD_NEXT, name);
        if (fn != NULL) {
            __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
        }
    }
    return fn;
}

static const struct cumem_rs_preload_hooks *current_hooks(void) {
    return __atomic_load_n(&hooks_slot, __ATOMIC_ACQUIRE);
}

/* The calling thread's current device, as the real cudaMalloc would use it. Without a cudaGetDevice to ask
 * (no runtime, or one that does not export it) there is no answer: CUMEM_RS_NO_GET_DEVICE, *device untouched,
 * never a guess (a process using device 1 would otherwise get memory on device 0). The extension asks only for
 * allocations on the CUDA driver (the simulated driver's devices are not the runtime's). */
static int current_device(int *device) {
    get_device_fn get = (get_device_fn)real(&real_get_device_slot, "cudaGetDevice");
    return get == NULL ? CUMEM_RS_NO_GET_DEVICE : get(device);
}

/* What the hooks are given as the calling thread's device (the same function), for diagnostics and tests. */
int cumem_rs_preload_current_device(int *device) {
    return current_device(device);
}

static int forward_malloc(void **ptr, size_t size) {
    malloc_fn fn = (malloc_fn)real(&real_malloc_slot, "cudaMalloc");
    return fn == NULL ? CUDA_ERROR_INITIALIZATION_ : fn(ptr, size);
}

static int forward_free(void *ptr) {
    free_fn fn = (free_fn)real(&real_free_slot, "cudaFree");
    return fn == NULL ? CUDA_ERROR_INITIALIZATION_ : fn(ptr);
}

int cudaMalloc(void **ptr, size_t size) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    if (h != NULL) {
        int rc = h->malloc_hook(ptr, size, current_device);
        if (rc != CUMEM_RS_NOT_OURS) {
            return rc;
        }
    }
    return forward_malloc(ptr, size);
}

int cudaFree(void *ptr) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    /* cudaFree(NULL) is how programs create the context: always the runtime's. */
    if (ptr != NULL && h != NULL) {
        int rc = h->free_hook(ptr);
        if (rc != CUMEM_RS_NOT_OURS) {
            return rc;
        }
    }
    return forward_free(ptr);
}

/* Tell the extension about a successful call of another allocator (nothing without hooks). */
static void report_unrouted(const char *call, size_t size) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    if (h != NULL) {
        h->unrouted_hook(call, size);
    }
}

int cudaMallocAsync(void **ptr, size_t size, void *stream) {
    malloc_async_fn fn = (malloc_async_fn)real(&real_malloc_async_slot, "cudaMallocAsync");
    int rc = fn == NULL ? CUDA_ERROR_INITIALIZATION_ : fn(ptr, size, stream);
    if (rc == CUDA_SUCCESS_) {
        report_unrouted("cudaMallocAsync", size);
    }
    return rc;
}

int cudaFreeAsync(void *ptr, void *stream) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    /* A pointer of ours never reaches the runtime, which did not allocate it. */
    if (ptr != NULL && h != NULL) {
        int rc = h->free_hook(ptr);
        if (rc != CUMEM_RS_NOT_OURS) {
            return rc;
        }
    }
    free_async_fn fn = (free_async_fn)real(&real_free_async_slot, "cudaFreeAsync");
    int rc = fn == NULL ? CUDA_ERROR_INITIALIZATION_ : fn(ptr, stream);
    if (rc == CUDA_SUCCESS_ && ptr != NULL) {
        report_unrouted("cudaFreeAsync", 0);
    }
    return rc;
}

int cudaMallocManaged(void **ptr, size_t size, unsigned int flags) {
    malloc_managed_fn fn = (malloc_managed_fn)real(&real_malloc_managed_slot, "cudaMallocManaged");
    int rc = fn == NULL ? CUDA_ERROR_INITIALIZATION_ : fn(ptr, size, flags);
    if (rc == CUDA_SUCCESS_) {
        report_unrouted("cudaMallocManaged", size);
    }
    return rc;
}

/* torch_memory_saver's C entry points of the same names: pause / resume a tag (NULL: every tag). */
int tms_pause(const char *tag) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    return h == NULL ? CUDA_ERROR_INITIALIZATION_ : h->pause_hook(tag);
}

int tms_resume(const char *tag) {
    const struct cumem_rs_preload_hooks *h = current_hooks();
    return h == NULL ? CUDA_ERROR_INITIALIZATION_ : h->resume_hook(tag);
}

/* Called by the extension once it is imported: 0 when the hooks are installed, the library's ABI otherwise. */
int cumem_rs_preload_register(const struct cumem_rs_preload_hooks *hooks) {
    if (hooks == NULL || hooks->abi != CUMEM_RS_PRELOAD_ABI) {
        return (int)CUMEM_RS_PRELOAD_ABI;
    }
    __atomic_store_n(&hooks_slot, hooks, __ATOMIC_RELEASE);
    return 0;
}

unsigned cumem_rs_preload_abi(void) {
    return CUMEM_RS_PRELOAD_ABI;
}
