/*
 * cumem_rs's preload hook: an LD_PRELOAD library that defines the CUDA runtime's cudaMalloc and cudaFree.
 *
 * It holds no allocator of its own. Until the cumem_rs extension is imported and registers its hooks
 * (cumem_rs_preload_register), every call goes to the real runtime; afterwards the extension decides per call
 * whether an allocation is its own (a region active on the calling thread, or TMS_INIT_ENABLE=1) and frees only
 * pointers it handed out. Everything else is forwarded, found with dlsym(RTLD_NEXT, ...) at the first call, so a
 * process that never pauses runs as without this library: cudaFree(0) (context creation), pointers from before
 * the extension was imported and pointers that are not ours reach the real runtime unchanged.
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

/* What a hook returns for a call that is not the extension's: forward it to the real runtime. */
#define CUMEM_RS_NOT_OURS (-1)

/* The ABI between this library and the extension; bumped on any change to struct cumem_rs_preload_hooks. */
#define CUMEM_RS_PRELOAD_ABI 1u

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
};

/* Declared here rather than taken from cuda_runtime_api.h: no CUDA headers at build time. */
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int tms_pause(const char *tag);
int tms_resume(const char *tag);
int cumem_rs_preload_register(const struct cumem_rs_preload_hooks *hooks);
unsigned cumem_rs_preload_abi(void);

/* One atomic slot: the extension's hooks (static storage in the extension, never freed), or NULL. */
static const struct cumem_rs_preload_hooks *hooks_slot;

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*get_device_fn)(int *);

static void *real_malloc_slot;
static void *real_free_slot;
static void *real_get_device_slot;

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

/* The calling thread's current device, as the real cudaMalloc would use it; device 0 without a runtime (the
 * simulated driver). */
static int current_device(int *device) {
    get_device_fn get = (get_device_fn)real(&real_get_device_slot, "cudaGetDevice");
    if (get == NULL) {
        *device = 0;
        return CUDA_SUCCESS_;
    }
    return get(device);
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
