/* The loader's reader loop in C (runtime/weights/native_reader.py loads it with ctypes, which releases the
 * GIL for the whole call).
 *
 * Why: the staged path reads a piece into a pinned slot and has the copy engine read it to the GPU. When the
 * slot is still in the CPU's cache at that moment, the copy engine reads it from there and the bytes cross
 * host memory twice (page cache -> slot, written back), not three times. That needs small slots (4 MiB: a
 * ring of 16 readers x 2 slots stays inside the 300 MiB L3 of the H100 machine), and from Python each piece
 * costs a few hand-overs of the GIL, so from Python small pieces are slower than 16 MiB ones. In C, with the
 * same threads, 4 MiB pieces are faster than a plain parallel read of the same files (docs/weights.md;
 * scripts/bench_weights.py measures both).
 *
 * libcuda is opened with dlopen, so this file compiles without the CUDA toolkit and loads on a machine with
 * no GPU (thaw_read only). Each reader thread has its own ring; the CUDA context is the calling thread's. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

static CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*event_record)(CUevent, CUstream);
static CUresult (*event_synchronize)(CUevent);

#define THAW_END_OF_FILE 1
#define THAW_CUDA_FAILED 2
#define THAW_MAX_SLOTS 8

/* 0 once libcuda.so.1 and the three calls are found, else -1 (thaw_read still works). */
int thaw_cuda_init(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda)
        return -1;
    memcpy_htod_async = dlsym(cuda, "cuMemcpyHtoDAsync_v2");
    event_record = dlsym(cuda, "cuEventRecord");
    event_synchronize = dlsym(cuda, "cuEventSynchronize");
    return memcpy_htod_async && event_record && event_synchronize ? 0 : -1;
}

/* n bytes at offset of fd into dst: 0, -errno of a failed read, or THAW_END_OF_FILE if the file ends first. */
int thaw_read(int fd, long long offset, long long n, char *dst) {
    long long got = 0;
    while (got < n) {
        ssize_t r = pread(fd, dst + got, (size_t)(n - got), offset + got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return THAW_END_OF_FILE;
        got += r;
    }
    return 0;
}

/* One reader's pinned slots and the event of each slot's last copy, kept across calls. Laid out as
 * native_reader.py's Ring. */
struct thaw_ring {
    char *slots[THAW_MAX_SLOTS];
    CUevent events[THAW_MAX_SLOTS];
    int pending[THAW_MAX_SLOTS];
    int n_slots;
    long long slot_bytes;
    long long turn;
    CUstream stream;
    int last;        /* the slot whose event was recorded last: it marks every copy made so far */
    int cuda_error;  /* the CUresult of the call that failed */
};

/* n bytes at offset of fd to device address dst, slot_bytes at a time: each read into the next slot of the
 * ring (once the slot's previous copy has left it), then copied on the ring's stream. Returns as soon as
 * the last copy is queued: 0, -errno, THAW_END_OF_FILE, or THAW_CUDA_FAILED (ring->cuda_error). */
int thaw_read_to_device(int fd, long long offset, long long n, CUdeviceptr dst, struct thaw_ring *ring) {
    for (long long done = 0; done < n; done += ring->slot_bytes) {
        long long piece = n - done < ring->slot_bytes ? n - done : ring->slot_bytes;
        int k = (int)(ring->turn++ % ring->n_slots);
        CUresult err;
        if (ring->pending[k] && (err = event_synchronize(ring->events[k])) != 0) {
            ring->cuda_error = err;
            return THAW_CUDA_FAILED;
        }
        ring->pending[k] = 0;
        int status = thaw_read(fd, offset + done, piece, ring->slots[k]);
        if (status != 0)
            return status;
        if ((err = memcpy_htod_async(dst + done, ring->slots[k], (size_t)piece, ring->stream)) != 0 ||
            (err = event_record(ring->events[k], ring->stream)) != 0) {
            ring->cuda_error = err;
            return THAW_CUDA_FAILED;
        }
        ring->pending[k] = 1;
        ring->last = k;
    }
    return 0;
}
