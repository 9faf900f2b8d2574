/*
 * fastckpt._native: GIL-free XXH3-128 hashing and fused file read+hash / write for the transfer engine.
 *
 * Built by setup.py against the system xxHash (libxxhash-dev); fastckpt/integrity.py holds the
 * pure-Python fallback with the same functions and results. Digests are the canonical (big-endian)
 * 16-byte form, identical to xxhash.xxh3_128_digest().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <unistd.h>

#include <xxhash.h>
#ifdef FASTCKPT_XXH_DISPATCH
#include <xxh_x86dispatch.h> /* runtime SSE2/AVX2/AVX512 selection; replaces the XXH3_* names */
#endif

/* Hashes shorter than this keep the GIL: they take a few microseconds, less than a GIL hand-over. */
#define GIL_MIN_SIZE (64 * 1024)
/* read_and_hash reads and hashes this much at a time, so the bytes are hashed while still in cache. */
#define READ_PIECE (1024 * 1024)

static PyObject *
digest_object(XXH128_hash_t hash)
{
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, hash);
    return PyBytes_FromStringAndSize((const char *)canon.digest, sizeof(canon.digest));
}

static int
get_buffer(PyObject *obj, Py_buffer *view, int writable)
{
    /* PyBUF_SIMPLE / PyBUF_WRITABLE both ask for one contiguous block; BufferError otherwise. */
    return PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

static int
check_offset(long long offset)
{
    if (offset < 0) {
        PyErr_Format(PyExc_ValueError, "offset must be >= 0, got %lld", offset);
        return -1;
    }
    return 0;
}

/* PEP 475: after EINTR run the signal handlers (with the GIL); retry unless one raised. */
static int
retry_after_eintr(PyThreadState **ts)
{
    PyEval_RestoreThread(*ts);
    if (PyErr_CheckSignals() < 0)
        return -1;
    *ts = PyEval_SaveThread();
    return 0;
}

PyDoc_STRVAR(xxh3_128_doc,
"xxh3_128(buf) -> bytes\n\n"
"XXH3-128 digest (16 bytes, canonical form) of a bytes-like object; the GIL is released\n"
"for buffers of GIL_MIN_SIZE (64 KiB) or more.");

static PyObject *
native_xxh3_128(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    XXH128_hash_t hash;

    if (get_buffer(arg, &view, 0) < 0)
        return NULL;
    if (view.len >= GIL_MIN_SIZE) {
        Py_BEGIN_ALLOW_THREADS
        hash = XXH3_128bits(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    }
    else {
        hash = XXH3_128bits(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return digest_object(hash);
}

PyDoc_STRVAR(xxh3_128_chunks_doc,
"xxh3_128_chunks(buf, chunk_size) -> list[bytes]\n\n"
"Digests of buf cut into chunk_size pieces (the last may be shorter); the GIL is released\n"
"for buffers of GIL_MIN_SIZE (64 KiB) or more.");

static PyObject *
native_xxh3_128_chunks(PyObject *module, PyObject *args)
{
    PyObject *obj, *result = NULL;
    Py_ssize_t chunk, count, i;
    Py_buffer view;
    XXH128_hash_t *hashes;
    const char *base;
    PyThreadState *ts;

    if (!PyArg_ParseTuple(args, "On:xxh3_128_chunks", &obj, &chunk))
        return NULL;
    if (chunk <= 0)
        return PyErr_Format(PyExc_ValueError, "chunk_size must be > 0, got %zd", chunk);
    if (get_buffer(obj, &view, 0) < 0)
        return NULL;
    count = view.len / chunk + (view.len % chunk != 0);
    hashes = PyMem_New(XXH128_hash_t, count ? count : 1);
    if (hashes == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    base = (const char *)view.buf;
    ts = view.len >= GIL_MIN_SIZE ? PyEval_SaveThread() : NULL;
    for (i = 0; i < count; i++) {
        Py_ssize_t start = i * chunk;
        Py_ssize_t len = view.len - start < chunk ? view.len - start : chunk;
        hashes[i] = XXH3_128bits(base + start, (size_t)len);
    }
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);

    result = PyList_New(count);
    for (i = 0; result != NULL && i < count; i++) {
        PyObject *digest = digest_object(hashes[i]);
        if (digest == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, digest);
    }
    PyMem_Free(hashes);
    return result;
}

PyDoc_STRVAR(read_and_hash_doc,
"read_and_hash(fd, offset, buf) -> bytes\n\n"
"Fill the writable buffer buf from file descriptor fd at offset and return its XXH3-128 digest.\n"
"Reads and hashes piece by piece with the GIL released; short reads are continued, EINTR retried.\n"
"EOFError when the file ends before buf is full, OSError on a failed read.");

static PyObject *
native_read_and_hash(PyObject *module, PyObject *args)
{
    PyObject *obj;
    int fd, saved_errno = 0;
    long long offset;
    Py_buffer view;
    XXH3_state_t *state;
    PyThreadState *ts;
    char *base;
    size_t done = 0, total;
    XXH128_hash_t hash;

    if (!PyArg_ParseTuple(args, "iLO:read_and_hash", &fd, &offset, &obj))
        return NULL;
    if (check_offset(offset) < 0 || get_buffer(obj, &view, 1) < 0)
        return NULL;
    state = XXH3_createState();
    if (state == NULL || XXH3_128bits_reset(state) != XXH_OK) {
        XXH3_freeState(state);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    base = (char *)view.buf;
    total = (size_t)view.len;

    ts = PyEval_SaveThread();
    while (done < total) {
        size_t want = total - done < READ_PIECE ? total - done : READ_PIECE;
        ssize_t n = pread(fd, base + done, want, (off_t)(offset + (long long)done));
        if (n < 0) {
            if (errno == EINTR) {
                if (retry_after_eintr(&ts) < 0)
                    goto error_with_gil;
                continue;
            }
            saved_errno = errno;
            break;
        }
        if (n == 0)
            break;
        XXH3_128bits_update(state, base + done, (size_t)n);
        done += (size_t)n;
    }
    PyEval_RestoreThread(ts);

    if (saved_errno != 0) {
        errno = saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        goto error_with_gil;
    }
    if (done < total) {
        PyErr_Format(PyExc_EOFError, "end of file at byte %lld: wanted %zu bytes from offset %lld, got %zu",
                     offset + (long long)done, total, offset, done);
        goto error_with_gil;
    }
    hash = XXH3_128bits_digest(state);
    XXH3_freeState(state);
    PyBuffer_Release(&view);
    return digest_object(hash);

error_with_gil:
    XXH3_freeState(state);
    PyBuffer_Release(&view);
    return NULL;
}

/* Bytes per pwrite: one huge pwrite into the page cache costs several times its size in slices. */
#define WRITE_SLICE ((size_t)1 << 20)

PyDoc_STRVAR(write_at_doc,
"write_at(fd, offset, buf) -> None\n\n"
"Write all of buf to file descriptor fd at offset with the GIL released (short writes continued,\n"
"EINTR retried); OSError on a failed write.");

static PyObject *
native_write_at(PyObject *module, PyObject *args)
{
    PyObject *obj;
    int fd, saved_errno = 0;
    long long offset;
    Py_buffer view;
    PyThreadState *ts;
    const char *base;
    size_t done = 0, total;

    if (!PyArg_ParseTuple(args, "iLO:write_at", &fd, &offset, &obj))
        return NULL;
    if (check_offset(offset) < 0 || get_buffer(obj, &view, 0) < 0)
        return NULL;
    base = (const char *)view.buf;
    total = (size_t)view.len;

    ts = PyEval_SaveThread();
    while (done < total) {
        size_t want = total - done < WRITE_SLICE ? total - done : WRITE_SLICE;
        ssize_t n = pwrite(fd, base + done, want, (off_t)(offset + (long long)done));
        if (n < 0) {
            if (errno == EINTR) {
                if (retry_after_eintr(&ts) < 0) {
                    PyBuffer_Release(&view);
                    return NULL;
                }
                continue;
            }
            saved_errno = errno;
            break;
        }
        if (n == 0) {
            saved_errno = EIO; /* no progress on a regular file: never loop forever */
            break;
        }
        done += (size_t)n;
    }
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);

    if (saved_errno != 0) {
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"xxh3_128", native_xxh3_128, METH_O, xxh3_128_doc},
    {"xxh3_128_chunks", native_xxh3_128_chunks, METH_VARARGS, xxh3_128_chunks_doc},
    {"read_and_hash", native_read_and_hash, METH_VARARGS, read_and_hash_doc},
    {"write_at", native_write_at, METH_VARARGS, write_at_doc},
    {NULL, NULL, 0, NULL},
};

static int
native_exec(PyObject *module)
{
    unsigned v = XXH_versionNumber();
    PyObject *version = PyUnicode_FromFormat("%u.%u.%u", v / 10000, (v / 100) % 100, v % 100);
    int rc;

    if (version == NULL)
        return -1;
    rc = PyModule_AddObjectRef(module, "XXHASH_VERSION", version);
    Py_DECREF(version);
    if (rc < 0)
        return -1;
#ifdef FASTCKPT_XXH_DISPATCH
    if (PyModule_AddIntConstant(module, "DISPATCH", 1) < 0)
#else
    if (PyModule_AddIntConstant(module, "DISPATCH", 0) < 0)
#endif
        return -1;
    return PyModule_AddIntConstant(module, "GIL_MIN_SIZE", GIL_MIN_SIZE);
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "fastckpt._native",
    "GIL-free XXH3-128 hashing and fused file read+hash / write (see fastckpt.integrity).",
    0,
    native_methods,
    native_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
