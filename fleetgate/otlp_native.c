/* One span as OTLP protobuf bytes, in C: the same bytes as `SpanEncoder.span` (fleetgate/otlp.py)
 * writes in Python, for a tenth of its time. Built at first use by fleetgate/otlp_native.py with the
 * system's C compiler; without one the Python encoder serves.
 *
 * encode_span(span) reads the span's slots (name, trace_id, span_id, parent_id, kind, start_ns,
 * end_ns, tracestate, attributes) and returns a `ScopeSpans.spans` entry: tag 0x12, the length,
 * then the `Span` message with its fields in the Python encoder's order (trace and span ids,
 * parent id, kind, start and end times, flags, name, tracestate, attributes, status).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KIND_SERVER 2
#define STATUS_ERROR 2

typedef struct {
    unsigned char *data;
    size_t len, cap;
    unsigned char inline_data[1024];
} Buffer;

static int reserve(Buffer *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap * 2;
    while (cap < b->len + more) cap *= 2;
    unsigned char *grown = b->data == b->inline_data ? PyMem_Malloc(cap) : PyMem_Realloc(b->data, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (b->data == b->inline_data) memcpy(grown, b->inline_data, b->len);
    b->data = grown;
    b->cap = cap;
    return 0;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

/* v as a protobuf varint at dst (room for 10 bytes); returns the bytes written */
static size_t write_varint(unsigned char *dst, uint64_t v) {
    size_t n = 0;
    while (v > 0x7F) {
        dst[n++] = (unsigned char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    dst[n++] = (unsigned char)v;
    return n;
}

/* callers reserve first */
static void put_varint(Buffer *b, uint64_t v) { b->len += write_varint(b->data + b->len, v); }

static void put_byte(Buffer *b, unsigned char c) { b->data[b->len++] = c; }

static void put_bytes(Buffer *b, const char *p, size_t n) {
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void put_be64(Buffer *b, uint64_t v) {
    for (int i = 7; i >= 0; i--) b->data[b->len++] = (unsigned char)(v >> (8 * i));
}

static void put_le(Buffer *b, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) b->data[b->len++] = (unsigned char)(v >> (8 * i));
}

/* tag, length, payload of a length-delimited field, in room already reserved */
static void put_field(Buffer *b, unsigned char tag, const char *p, size_t n) {
    put_byte(b, tag);
    put_varint(b, n);
    put_bytes(b, p, n);
}

/* the same, reserving its room first */
static int put_len_field(Buffer *b, unsigned char tag, const char *p, size_t n) {
    if (reserve(b, 1 + 10 + n) < 0) return -1;
    put_field(b, tag, p, n);
    return 0;
}

static PyObject *s_name, *s_trace_id, *s_span_id, *s_parent_id, *s_kind, *s_start_ns, *s_end_ns,
    *s_tracestate, *s_attributes, *s_error_type, *s_shift64;

static int get_u64(PyObject *span, PyObject *attr, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(span, attr);
    if (v == NULL) return -1;
    *out = PyLong_AsUnsignedLongLongMask(v);
    Py_DECREF(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* One `Span.attributes` entry (field 9): KeyValue {1 key, 2 AnyValue}. AnyValue: string 1, bool 2,
 * int 3 (int64, two's complement), double 4; other types are sent as their str(). */
static int put_attribute(Buffer *b, PyObject *key, PyObject *value) {
    Py_ssize_t key_len;
    const char *key_utf8 = PyUnicode_AsUTF8AndSize(key, &key_len);
    if (key_utf8 == NULL) return -1;
    unsigned char scalar[11];
    size_t scalar_len = 0, any_len;
    const char *text = NULL;
    Py_ssize_t text_len = 0;
    PyObject *as_str = NULL;
    unsigned char value_tag;
    if (PyBool_Check(value)) {
        value_tag = 0x10;
        scalar[0] = value == Py_True;
        scalar_len = 1;
    } else if (PyLong_Check(value)) {
        uint64_t v = PyLong_AsUnsignedLongLongMask(value);
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
        value_tag = 0x18;
        scalar_len = write_varint(scalar, v);
    } else if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        uint64_t bits;
        memcpy(&bits, &d, sizeof bits);
        value_tag = 0x21;
        for (int i = 0; i < 8; i++) scalar[scalar_len++] = (unsigned char)(bits >> (8 * i));
    } else {
        value_tag = 0x0a;
        if (PyUnicode_CheckExact(value)) {
            text = PyUnicode_AsUTF8AndSize(value, &text_len);
        } else {
            as_str = PyObject_Str(value);
            if (as_str == NULL) return -1;
            text = PyUnicode_AsUTF8AndSize(as_str, &text_len);
        }
        if (text == NULL) {
            Py_XDECREF(as_str);
            return -1;
        }
    }
    any_len = text != NULL ? 1 + varint_size((uint64_t)text_len) + (size_t)text_len : 1 + scalar_len;
    size_t kv_len = 1 + varint_size((uint64_t)key_len) + (size_t)key_len + 1 + varint_size(any_len) + any_len;
    if (reserve(b, 1 + 10 + kv_len) < 0) {
        Py_XDECREF(as_str);
        return -1;
    }
    put_byte(b, 0x4a);
    put_varint(b, kv_len);
    put_field(b, 0x0a, key_utf8, (size_t)key_len);
    put_byte(b, 0x12);
    put_varint(b, any_len);
    if (text != NULL) {
        put_field(b, value_tag, text, (size_t)text_len);
    } else {
        put_byte(b, value_tag);
        put_bytes(b, (const char *)scalar, scalar_len);
    }
    Py_XDECREF(as_str);
    return 0;
}

/* What the encoder needs of a span, read from a Python span's attributes (`encode_span`) or from a
 * native span's struct (`Span` below); the objects are borrowed. */
typedef struct {
    uint64_t trace_high, trace_low, span_id, parent_id, kind, start_ns, end_ns;
    PyObject *name, *tracestate, *attributes;
} SpanFields;

static int put_span_fields(Buffer *b, const SpanFields *f);

/* reads a Python span's attributes into `f` (new references in *owned, released by the caller) */
static int read_span(PyObject *span, SpanFields *f, PyObject *owned[3]) {
    PyObject *trace_id = PyObject_GetAttr(span, s_trace_id);
    if (trace_id == NULL) return -1;
    f->trace_low = PyLong_AsUnsignedLongLongMask(trace_id);
    if (f->trace_low == (uint64_t)-1 && PyErr_Occurred()) {
        Py_DECREF(trace_id);
        return -1;
    }
    PyObject *high = PyNumber_Rshift(trace_id, s_shift64);
    Py_DECREF(trace_id);
    if (high == NULL) return -1;
    f->trace_high = PyLong_AsUnsignedLongLongMask(high);
    Py_DECREF(high);
    if (PyErr_Occurred()) return -1;
    if (get_u64(span, s_span_id, &f->span_id) < 0 || get_u64(span, s_parent_id, &f->parent_id) < 0 ||
        get_u64(span, s_kind, &f->kind) < 0 || get_u64(span, s_start_ns, &f->start_ns) < 0 ||
        get_u64(span, s_end_ns, &f->end_ns) < 0)
        return -1;
    if ((owned[0] = f->name = PyObject_GetAttr(span, s_name)) == NULL) return -1;
    if ((owned[1] = f->tracestate = PyObject_GetAttr(span, s_tracestate)) == NULL) return -1;
    if ((owned[2] = f->attributes = PyObject_GetAttr(span, s_attributes)) == NULL) return -1;
    return 0;
}

static int put_span_body(Buffer *b, PyObject *span) {
    SpanFields f;
    PyObject *owned[3] = {NULL, NULL, NULL};
    int failed = read_span(span, &f, owned) < 0 || put_span_fields(b, &f) < 0;
    for (int i = 0; i < 3; i++) Py_XDECREF(owned[i]);
    return failed ? -1 : 0;
}

static int put_span_fields(Buffer *b, const SpanFields *f) {
    uint64_t trace_high = f->trace_high, trace_low = f->trace_low, span_id = f->span_id,
             parent_id = f->parent_id, kind = f->kind, start_ns = f->start_ns, end_ns = f->end_ns;
    if (kind > 0x7F) {
        PyErr_SetString(PyExc_ValueError, "span kind out of range");
        return -1;
    }
    if (reserve(b, 64) < 0) return -1;
    put_byte(b, 0x0a);  /* 1 trace_id: 16 bytes, big-endian */
    put_byte(b, 16);
    put_be64(b, trace_high);
    put_be64(b, trace_low);
    put_byte(b, 0x12);  /* 2 span_id */
    put_byte(b, 8);
    put_be64(b, span_id);
    if (parent_id) {  /* 4 parent_span_id */
        put_byte(b, 0x22);
        put_byte(b, 8);
        put_be64(b, parent_id);
    }
    put_byte(b, 0x30);  /* 6 kind */
    put_byte(b, (unsigned char)kind);
    put_byte(b, 0x39);  /* 7 start_time_unix_nano, fixed64 */
    put_le(b, start_ns, 8);
    put_byte(b, 0x41);  /* 8 end_time_unix_nano */
    put_le(b, end_ns, 8);
    /* 16 flags (fixed32): sampled, and bits 8-9 saying whether the parent is remote (only a
     * request's root span has a remote parent) */
    put_byte(b, 0x85);
    put_byte(b, 0x01);
    put_le(b, parent_id && kind == KIND_SERVER ? 0x301 : 0x101, 4);

    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(f->name, &n);
    int failed = utf8 == NULL || put_len_field(b, 0x2a, utf8, (size_t)n) < 0;  /* 5 name */
    if (failed) return -1;

    PyObject *tracestate = f->tracestate;
    int has_tracestate = PyObject_IsTrue(tracestate);
    if (has_tracestate < 0) {
        failed = 1;
    } else if (has_tracestate) {  /* 3 trace_state */
        utf8 = PyUnicode_AsUTF8AndSize(tracestate, &n);
        failed = utf8 == NULL || put_len_field(b, 0x1a, utf8, (size_t)n) < 0;
    }
    if (failed) return -1;

    PyObject *attributes = f->attributes;
    if (!PyDict_CheckExact(attributes)) {
        PyErr_SetString(PyExc_TypeError, "span attributes must be a dict");
        return -1;
    }
    PyObject *key, *value, *error = NULL;
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(attributes);
    while (PyDict_Next(attributes, &pos, &key, &value)) {
        if (value == Py_None) continue;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "span attribute keys must be str");
            failed = 1;
            break;
        }
        /* str() of a value may run Python code that changes the dict: hold both meanwhile */
        Py_INCREF(key);
        Py_INCREF(value);
        failed = put_attribute(b, key, value) < 0;
        Py_DECREF(key);
        Py_DECREF(value);
        if (!failed && PyDict_GET_SIZE(attributes) != size) {
            PyErr_SetString(PyExc_RuntimeError, "span attributes changed size while encoded");
            failed = 1;
        }
        if (failed) break;
    }
    if (!failed) error = PyDict_GetItemWithError(attributes, s_error_type);  /* borrowed */
    if (!failed && error == NULL && PyErr_Occurred()) failed = 1;
    if (!failed && error != NULL && error != Py_None) {  /* 15 status {2 message, 3 code} */
        const char *message = PyUnicode_AsUTF8AndSize(error, &n);
        if (message == NULL) {
            failed = 1;
        } else {
            size_t status_len = 1 + varint_size((uint64_t)n) + (size_t)n + 2;
            if (reserve(b, 1 + 10 + status_len) < 0) {
                failed = 1;
            } else {
                put_byte(b, 0x7a);
                put_varint(b, status_len);
                put_field(b, 0x12, message, (size_t)n);
                put_byte(b, 0x18);
                put_byte(b, STATUS_ERROR);
            }
        }
    }
    return failed ? -1 : 0;
}

/* the `ScopeSpans.spans` entry of a span: tag 0x12, the length, the body written by `put` */
static PyObject *encode_with(int (*put)(Buffer *, const void *), const void *source) {
    Buffer b;
    b.data = b.inline_data;
    b.len = 0;
    b.cap = sizeof b.inline_data;
    PyObject *result = NULL;
    if (put(&b, source) == 0) {
        size_t head = 1 + varint_size(b.len);
        result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head + b.len));
        if (result != NULL) {
            unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
            out[0] = 0x12;
            write_varint(out + 1, b.len);
            memcpy(out + head, b.data, b.len);
        }
    }
    if (b.data != b.inline_data) PyMem_Free(b.data);
    return result;
}

static int put_python_span(Buffer *b, const void *span) { return put_span_body(b, (PyObject *)span); }

static PyObject *encode_span(PyObject *module, PyObject *span) { return encode_with(put_python_span, span); }

#include "span_native.h"

static PyMethodDef methods[] = {
    {"encode_span", encode_span, METH_O, "A span's `ScopeSpans.spans` entry as OTLP protobuf bytes."},
    SPAN_NATIVE_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, methods, NULL, NULL, NULL, NULL,
};

#define CONCAT_(a, b) a##b
#define CONCAT(a, b) CONCAT_(a, b)

PyMODINIT_FUNC CONCAT(PyInit_, MODULE_SYMBOL)(void) {
    s_name = PyUnicode_InternFromString("name");
    s_trace_id = PyUnicode_InternFromString("trace_id");
    s_span_id = PyUnicode_InternFromString("span_id");
    s_parent_id = PyUnicode_InternFromString("parent_id");
    s_kind = PyUnicode_InternFromString("kind");
    s_start_ns = PyUnicode_InternFromString("start_ns");
    s_end_ns = PyUnicode_InternFromString("end_ns");
    s_tracestate = PyUnicode_InternFromString("tracestate");
    s_attributes = PyUnicode_InternFromString("attributes");
    s_error_type = PyUnicode_InternFromString("error.type");
    s_shift64 = PyLong_FromLong(64);
    if (!s_name || !s_trace_id || !s_span_id || !s_parent_id || !s_kind || !s_start_ns || !s_end_ns ||
        !s_tracestate || !s_attributes || !s_error_type || !s_shift64)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (span_native_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
