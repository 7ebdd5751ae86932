// 128-bit fingerprints of chunks of device memory, used to skip copying backups that did not change.
//
// One thread block per chunk. Each 16-byte word (lo, hi) at word index i of its chunk is hashed to
//   h = fmix64(lo ^ i*K1 ^ fmix64(hi ^ (i*K2 + K3)))
// which is a bijection of lo for fixed (hi, i) and of hi for fixed (lo, i): any change confined to one word
// always changes h. The chunk's fingerprint is
//   a = fmix64(sum(h) + len),  b = fmix64(sum((h ^ K4) * (2i + 1)) ^ (len * K1))
// (sums mod 2^64). Sums are order-independent, so the parallel reduction is deterministic; position enters
// through the word hash and the odd weights, so swapping words or moving a value elsewhere changes it.
// The host reference (rust/src/fingerprint.rs) computes the same function; keep the two identical.
//
// Regenerate the embedded PTX with scripts/gen_ptx.py after any change to this file.

typedef unsigned long long u64;

struct Chunk {
    u64 addr;  // device address of the chunk's first byte (16-byte aligned)
    u64 len;   // bytes, a multiple of 16
};

#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xC2B2AE3D27D4EB4FULL
#define K3 0x165667B19E3779F9ULL
#define K4 0x27D4EB2F165667C5ULL
#define THREADS 256
#define UNROLL 4

__device__ __forceinline__ u64 fmix64(u64 k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDULL;
    k ^= k >> 33;
    k *= 0xC4CEB9FE1A85EC53ULL;
    k ^= k >> 33;
    return k;
}

__device__ __forceinline__ void absorb(ulonglong2 w, u64 i, u64 &a, u64 &b) {
    u64 h = fmix64(w.x ^ (i * K1) ^ fmix64(w.y ^ (i * K2 + K3)));
    a += h;
    b += (h ^ K4) * (2 * i + 1);
}

extern "C" __global__ void __launch_bounds__(THREADS)
cumem_fingerprint(const Chunk *__restrict__ chunks, u64 *__restrict__ out) {
    const Chunk c = chunks[blockIdx.x];
    const ulonglong2 *p = (const ulonglong2 *)c.addr;
    const u64 words = c.len / 16;
    u64 a = 0, b = 0;
    u64 i = threadIdx.x;
    // Several independent loads in flight per thread: the kernel is bound by memory, not arithmetic.
    for (; i + (UNROLL - 1) * THREADS < words; i += UNROLL * THREADS) {
        ulonglong2 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) w[u] = __ldcs(p + i + u * THREADS);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) absorb(w[u], i + u * THREADS, a, b);
    }
    for (; i < words; i += THREADS) absorb(__ldcs(p + i), i, a, b);

    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xFFFFFFFFu, a, o);
        b += __shfl_down_sync(0xFFFFFFFFu, b, o);
    }
    __shared__ u64 sa[THREADS / 32], sb[THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        sa[warp] = a;
        sb[warp] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 ta = 0, tb = 0;
        for (int k = 0; k < THREADS / 32; k++) {
            ta += sa[k];
            tb += sb[k];
        }
        out[2 * blockIdx.x] = fmix64(ta + c.len);
        out[2 * blockIdx.x + 1] = fmix64(tb ^ (c.len * K1));
    }
}
