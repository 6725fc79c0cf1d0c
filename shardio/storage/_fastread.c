/* shardio.storage._fastread: a batch of preads, each member hashed (xxh3-64) as it lands.
 *
 * read_each (shardio/storage/opener.py) calls pread_many for a plain POSIX opener: the
 * whole batch runs with the GIL released once, where the Python path releases and takes
 * it back for every read and every hash (with reader threads, a context switch about
 * every second member) and spends a few microseconds of bytecode per member. The bytes,
 * outcomes and digests are the Python path's: tests/unit/storage/test_fastread.py runs
 * both on the same reads.
 *
 * pread_many(reads, hash[, progress]) -> (outcomes, digests, took)
 *   reads:    a sequence of (fd, offset, target), target a writable C-contiguous buffer;
 *   hash:     whether to hash each target that was filled completely;
 *   outcomes: per read, the bytes read (fewer than the target's size: the file ended
 *             first) or -errno;
 *   digests:  per read, the xxh3-64 of its target when hash and it was filled, else None;
 *             None when not hash;
 *   took:     per read, nanoseconds of its preads (CLOCK_MONOTONIC), the hash not included.
 * EINTR is retried after the signal handlers ran (with the GIL), as os.preadv does: an
 * exception they raise (KeyboardInterrupt) ends the call. A target that is not writable
 * raises BufferError before anything is read.
 *
 * pread_many(reads, hash, progress) also publishes each read while it runs, for a thread
 * that holds a deadline over the call (shardio/read/deadline.py): progress is a writable
 * buffer of 3 aligned int64, zeroed by the caller.
 *   progress[0]: the index of the read in progress, or of the last one;
 *   progress[1]: its start (CLOCK_MONOTONIC ns, as time.monotonic_ns), 0 between reads;
 *   progress[2]: set by stop_reads: no read starts after it. The lists then hold only the
 *                reads made (fewer than len(reads)).
 * stop_reads(progress) -> (index, start): stops the call and says which read was in
 * progress (start 0: none, and none will start). A read publishes its start before it
 * looks at the flag and stop_reads sets the flag before it looks at the start, both
 * sequentially consistent: of a read and a stop that race, at least one sees the other,
 * so a read that stop_reads did not see is never made (its target is not written).
 *
 * _xxhash/: xxHash 0.8.4 (BSD 2-Clause, _xxhash/LICENSE), as python-xxhash 4.1 ships it;
 * XXH3_64bits with seed 0 is xxhash.xxh3_64_intdigest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
/* xxHash's own dispatch: the long-input loop of XXH3 built for SSE2, AVX2 and AVX-512 and
 * chosen at the first call from what the CPU has, as python-xxhash's build does (the SSE2
 * loop alone hashed 110 KB members at about half the speed). */
#include "_xxhash/xxh_x86dispatch.c"
#define xxh3_64bits(input, len) XXH3_64bits_withSeed_dispatch((input), (len), 0)
#define HASH_KIND "x86-dispatch"
#else
#define XXH_INLINE_ALL
#include "_xxhash/xxhash.h"
#define xxh3_64bits XXH3_64bits
#define HASH_KIND "inline"
#endif

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {
    int fd;
    long long offset;
    Py_buffer view;
    long long outcome;
    unsigned long long digest;
    int hashed;
    long long took;
} Read;

static PyObject *build_result(Read *reads, Py_ssize_t n, int hash) {
    PyObject *outcomes = PyList_New(n), *took = PyList_New(n);
    PyObject *digests = hash ? PyList_New(n) : Py_NewRef(Py_None);
    PyObject *result = NULL;
    if (outcomes == NULL || took == NULL || digests == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromLongLong(reads[i].outcome);
        PyObject *t = PyLong_FromLongLong(reads[i].took);
        if (o == NULL || t == NULL) {
            Py_XDECREF(o);
            Py_XDECREF(t);
            goto done;
        }
        PyList_SET_ITEM(outcomes, i, o);
        PyList_SET_ITEM(took, i, t);
        if (hash) {
            PyObject *d = reads[i].hashed ? PyLong_FromUnsignedLongLong(reads[i].digest)
                                           : Py_NewRef(Py_None);
            if (d == NULL) goto done;
            PyList_SET_ITEM(digests, i, d);
        }
    }
    result = PyTuple_Pack(3, outcomes, digests, took);
done:
    Py_XDECREF(outcomes);
    Py_XDECREF(digests);
    Py_XDECREF(took);
    return result;
}

/* The progress buffer of pread_many and stop_reads: 3 aligned int64, or NULL (not given). */
static int progress_view(PyObject *given, Py_buffer *view, int64_t **words) {
    *words = NULL;
    if (given == Py_None) return 0;
    if (PyObject_GetBuffer(given, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < (Py_ssize_t)(3 * sizeof(int64_t)) || ((uintptr_t)view->buf % 8) != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "progress must be 3 aligned int64");
        return -1;
    }
    *words = (int64_t *)view->buf;
    return 0;
}

static PyObject *pread_many(PyObject *module, PyObject *args) {
    PyObject *given, *seq, *result = NULL, *progress_arg = Py_None;
    int hash, interrupted = 0;
    Py_ssize_t n, held = 0, i, made = 0;
    Read *reads;
    Py_buffer progress_buf;
    int64_t *progress;
    (void)module;
    if (!PyArg_ParseTuple(args, "Op|O:pread_many", &given, &hash, &progress_arg)) return NULL;
    if (progress_view(progress_arg, &progress_buf, &progress) < 0) return NULL;
    seq = PySequence_Fast(given, "pread_many: reads must be a sequence");
    if (seq == NULL) {
        if (progress != NULL) PyBuffer_Release(&progress_buf);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    reads = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Read));
    if (reads == NULL) {
        Py_DECREF(seq);
        if (progress != NULL) PyBuffer_Release(&progress_buf);
        return PyErr_NoMemory();
    }
    for (i = 0; i < n; i++) {
        PyObject *target;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iLO:pread_many", &reads[i].fd,
                              &reads[i].offset, &target))
            goto done;
        if (PyObject_GetBuffer(target, &reads[i].view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held++;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n && !interrupted; i++) {
        Read *r = &reads[i];
        char *at = r->view.buf;
        Py_ssize_t want = r->view.len, done = 0;
        int64_t began = now_ns();
        if (progress != NULL) {
            __atomic_store_n(&progress[0], (int64_t)i, __ATOMIC_SEQ_CST);
            __atomic_store_n(&progress[1], began, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&progress[2], __ATOMIC_SEQ_CST) != 0) {
                __atomic_store_n(&progress[1], 0, __ATOMIC_SEQ_CST);
                break; /* stopped: this read and the rest are not made */
            }
        }
        r->outcome = 0;
        while (done < want) {
            ssize_t got = pread(r->fd, at + done, (size_t)(want - done), (off_t)(r->offset + done));
            if (got > 0) {
                done += got;
                continue;
            }
            if (got == 0) break; /* the file ended first */
            if (errno == EINTR) {
                int raised;
                Py_BLOCK_THREADS
                raised = PyErr_CheckSignals();
                Py_UNBLOCK_THREADS
                if (raised < 0) {
                    interrupted = 1;
                    break;
                }
                continue;
            }
            r->outcome = -(long long)errno;
            break;
        }
        if (r->outcome == 0) r->outcome = done;
        r->took = now_ns() - began; /* the read's latency: the hash below is not in it */
        if (progress != NULL) __atomic_store_n(&progress[1], 0, __ATOMIC_SEQ_CST);
        made = i + 1;
        if (hash && !interrupted && done == want && r->outcome == want) {
            r->digest = (unsigned long long)xxh3_64bits(at, (size_t)want);
            r->hashed = 1;
        }
    }
    Py_END_ALLOW_THREADS
    if (!interrupted) result = build_result(reads, made, hash);
done:
    for (i = 0; i < held; i++) PyBuffer_Release(&reads[i].view);
    PyMem_Free(reads);
    Py_DECREF(seq);
    if (progress != NULL) PyBuffer_Release(&progress_buf);
    return result;
}

static PyObject *stop_reads(PyObject *module, PyObject *arg) {
    Py_buffer view;
    int64_t *progress, index, began;
    (void)module;
    if (arg == Py_None) {
        PyErr_SetString(PyExc_TypeError, "stop_reads: progress must be a buffer");
        return NULL;
    }
    if (progress_view(arg, &view, &progress) < 0) return NULL;
    __atomic_store_n(&progress[2], 1, __ATOMIC_SEQ_CST);
    for (;;) { /* a start, and the index published before it (both again if it moved on) */
        began = __atomic_load_n(&progress[1], __ATOMIC_SEQ_CST);
        index = __atomic_load_n(&progress[0], __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&progress[1], __ATOMIC_SEQ_CST) == began) break;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(LL)", (long long)index, (long long)began);
}

static PyObject *xxh3_64(PyObject *module, PyObject *arg) {
    Py_buffer view;
    XXH64_hash_t digest;
    (void)module;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    digest = xxh3_64bits(view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)digest);
}

static PyMethodDef methods[] = {
    {"pread_many", pread_many, METH_VARARGS,
     "pread_many(reads, hash) -> (outcomes, digests, took): see the module's source."},
    {"stop_reads", stop_reads, METH_O,
     "stop_reads(progress) -> (index, start): stop a pread_many; the read in progress."},
    {"xxh3_64", xxh3_64, METH_O, "xxh3_64(buffer) -> int: the xxh3-64 (seed 0) pread_many computes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "shardio.storage._fastread",
    "A batch of preads with the GIL released once, each member hashed (xxh3-64) as it lands.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastread(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddStringConstant(module, "HASH_KIND", HASH_KIND) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
