/* The span itself in C: `Span`, `child` and the hand-off of an ended span, for fleetgate/tracing.py.
 *
 * Part of the one translation unit of otlp_native.c (included there: it writes spans with that
 * file's static encoder). Why in C: a traced request makes six spans, and in Python each costs a
 * constructor, `__enter__`, `__exit__`, a context variable set and reset, a call to the exporter and
 * an encoding call: +50 us on a digits request's ~575 us of CPU in process, +21 us with this type
 * and the root span started here too (`bench/bench_tracing_inprocess.py`, medians of paired rounds).
 * This type keeps the Python `Span`'s interface and behaviour (tracing.py's docstrings hold), so a
 * gateway without a C compiler runs the Python one unchanged; the tests run both.
 *
 * Module state, set from Python by `bind` (once tracing is on):
 * - the context variable holding the current span, the shared no-op context manager `child`
 *   returns when there is nothing to record, and the Python `child` for a parent that is not one
 *   of these spans (a span begun before tracing switched implementation);
 * - where an ended, recording span goes (`set_sink`): nowhere (tracing off), a Python callable
 *   (an SDK exporter), or straight into a batch exporter's queue as encoded bytes, with the
 *   queue's limits and the exporter's callbacks for a full queue and an unencodable span.
 * Span and new traces' ids come from a xorshift generator that `bind` seeds from `os.urandom` in
 * each process: unique, not secret, as Python's `random` ids were. `start_span` and `span` start a
 * request's root span by tracing.py's rules (parent-based ratio sampling, `set_sample_bound`).
 */
#include <time.h>

#define KIND_INTERNAL 1

typedef struct {
    PyObject_HEAD
    PyObject *name;
    uint64_t trace_high, trace_low, span_id, parent_id;
    int recording, kind;
    PyObject *attributes; /* dict */
    PyObject *tracestate; /* str */
    uint64_t start_ns, end_ns;
    PyObject *token; /* the context variable's token while the span is current by `with` */
} NativeSpan;

static PyTypeObject NativeSpanType;
#define NativeSpan_Check(o) (Py_TYPE(o) == &NativeSpanType)

static PyObject *g_current;       /* ContextVar */
static PyObject *g_null;          /* contextlib.nullcontext() */
static PyObject *g_python_child;  /* tracing._python_child */
static uint64_t g_rng = 0x9E3779B97F4A7C15ULL;
/* parent-based ratio sampling of new traces: kept when the trace id's low 64 bits are below the
 * bound, or always (ratio 1.0: the bound 2**64 does not fit 64 bits) */
static uint64_t g_sample_bound;
static int g_sample_all = 1;
static PyObject *s_empty; /* "": a new trace's tracestate */
/* where ended spans go */
static PyObject *g_sink;          /* callable(span), or NULL */
static PyObject *g_queue;         /* the batch exporter's deque, or NULL */
static PyObject *g_append;        /* g_queue.append */
static PyObject *g_wake, *g_on_full, *g_on_unencodable;
static Py_ssize_t g_max_queued, g_batch_size;

static uint64_t next_id(void) {
    uint64_t x;
    do { /* xorshift64*; zero is not a valid span id */
        g_rng ^= g_rng >> 12;
        g_rng ^= g_rng << 25;
        g_rng ^= g_rng >> 27;
        x = g_rng * 0x2545F4914F6CDD1DULL;
    } while (x == 0);
    return x;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns()'s clock */
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static NativeSpan *span_new(PyObject *name, uint64_t trace_high, uint64_t trace_low, uint64_t parent_id,
                            int recording, PyObject *attributes, int kind, PyObject *tracestate) {
    NativeSpan *self = PyObject_GC_New(NativeSpan, &NativeSpanType);
    if (self == NULL) return NULL;
    Py_INCREF(name);
    self->name = name;
    self->trace_high = trace_high;
    self->trace_low = trace_low;
    self->span_id = next_id();
    self->parent_id = parent_id;
    self->recording = recording;
    Py_INCREF(attributes);
    self->attributes = attributes;
    self->kind = kind;
    Py_INCREF(tracestate);
    self->tracestate = tracestate;
    self->start_ns = now_ns();
    self->end_ns = 0;
    self->token = NULL;
    PyObject_GC_Track(self);
    return self;
}

/* Span(name, trace_id, parent_id, recording, attributes, kind, tracestate), as the Python Span */
static PyObject *span_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *name, *trace_id, *parent_id, *attributes, *tracestate;
    int recording, kind;
    static char *names[] = {"name", "trace_id", "parent_id", "recording", "attributes", "kind", "tracestate", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UOOpO!iU:Span", names, &name, &trace_id, &parent_id,
                                     &recording, &PyDict_Type, &attributes, &kind, &tracestate))
        return NULL;
    if (kind < 0 || kind > 0x7F) {
        PyErr_SetString(PyExc_ValueError, "span kind out of range");
        return NULL;
    }
    uint64_t low = PyLong_AsUnsignedLongLongMask(trace_id);
    if (low == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *high_obj = PyNumber_Rshift(trace_id, s_shift64);
    if (high_obj == NULL) return NULL;
    uint64_t high = PyLong_AsUnsignedLongLongMask(high_obj);
    Py_DECREF(high_obj);
    if (high == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t parent = PyLong_AsUnsignedLongLongMask(parent_id);
    if (parent == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    return (PyObject *)span_new(name, high, low, parent, recording, attributes, kind, tracestate);
}

static int span_traverse(NativeSpan *self, visitproc visit, void *arg) {
    Py_VISIT(self->name);
    Py_VISIT(self->attributes);
    Py_VISIT(self->tracestate);
    Py_VISIT(self->token);
    return 0;
}

/* only the attributes and the token can hold a cycle; name and tracestate are str, kept so the
 * getters never meet NULL (the attributes' users check for it) */
static int span_clear(NativeSpan *self) {
    Py_CLEAR(self->attributes);
    Py_CLEAR(self->token);
    return 0;
}

static void span_dealloc(NativeSpan *self) {
    PyObject_GC_UnTrack(self);
    span_clear(self);
    Py_CLEAR(self->name);
    Py_CLEAR(self->tracestate);
    PyObject_GC_Del(self);
}

static int put_native_span(Buffer *b, const void *source) {
    const NativeSpan *s = (const NativeSpan *)source;
    SpanFields f = {s->trace_high, s->trace_low, s->span_id, s->parent_id, (uint64_t)s->kind,
                    s->start_ns, s->end_ns, s->name, s->tracestate, s->attributes};
    return put_span_fields(b, &f);
}

/* The queue path of `deliver`, on strong references taken at its start: encoding runs Python code
 * (str() of a value) that may switch tracing, which releases the module's own references. */
static int deliver_queued(NativeSpan *self, PyObject *queue, PyObject *append, PyObject *wake, PyObject *on_full,
                          PyObject *on_unencodable, Py_ssize_t max_queued, Py_ssize_t batch_size) {
    Py_ssize_t queued = PyObject_Size(queue);
    if (queued < 0) return -1;
    if (queued >= max_queued) {
        PyObject *r = PyObject_CallNoArgs(on_full);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if (self->attributes == NULL) return 0; /* cleared by the collector: nothing left to send */
    /* the attributes may be replaced while str() of a value runs Python code: hold them */
    PyObject *attributes = Py_NewRef(self->attributes);
    PyObject *encoded = encode_with(put_native_span, self);
    Py_DECREF(attributes);
    if (encoded == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *r = PyObject_CallFunctionObjArgs(on_unencodable, self->name, value ? value : Py_None, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *r = PyObject_CallOneArg(append, encoded);
    Py_DECREF(encoded);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (queued + 1 == batch_size) {
        r = PyObject_CallNoArgs(wake);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* Hands an ended, recording span to where spans go. A failure of the exporter's queue path (an
 * attribute that cannot be encoded) is the exporter's to count, never the request's. */
static int deliver(NativeSpan *self) {
    if (g_queue != NULL) {
        PyObject *queue = Py_NewRef(g_queue), *append = Py_NewRef(g_append), *wake = Py_NewRef(g_wake),
                 *on_full = Py_NewRef(g_on_full), *on_unencodable = Py_NewRef(g_on_unencodable);
        int failed = deliver_queued(self, queue, append, wake, on_full, on_unencodable, g_max_queued, g_batch_size);
        Py_DECREF(queue);
        Py_DECREF(append);
        Py_DECREF(wake);
        Py_DECREF(on_full);
        Py_DECREF(on_unencodable);
        return failed;
    }
    if (g_sink != NULL) {
        PyObject *sink = Py_NewRef(g_sink);
        PyObject *r = PyObject_CallOneArg(sink, (PyObject *)self);
        Py_DECREF(sink);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static int span_finish(NativeSpan *self) {
    if (self->end_ns) return 0;
    self->end_ns = now_ns();
    return self->recording ? deliver(self) : 0;
}

static PyObject *span_end(NativeSpan *self, PyObject *unused) {
    if (span_finish(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *span_enter(NativeSpan *self, PyObject *unused) {
    if (self->token != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span is already current in a `with` block");
        return NULL;
    }
    PyObject *token = PyContextVar_Set(g_current, (PyObject *)self);
    if (token == NULL) return NULL;
    Py_XSETREF(self->token, token);
    Py_INCREF(self);
    return (PyObject *)self;
}

/* the span's attributes as a new reference: Python code run by a dict operation (a key's __eq__, a
 * mapping's keys()) may replace them meanwhile; NULL (no error set) once the collector cleared them */
static PyObject *held_attributes(NativeSpan *self) { return Py_XNewRef(self->attributes); }

static int set_error_type(NativeSpan *self, PyObject *error) {
    PyObject *attributes = held_attributes(self);
    if (attributes == NULL) return 0;
    PyObject *type_name = PyObject_GetAttrString((PyObject *)Py_TYPE(error), "__name__");
    int failed = type_name == NULL ? -1 : PyDict_SetItem(attributes, s_error_type, type_name);
    Py_XDECREF(type_name);
    Py_DECREF(attributes);
    return failed;
}

static PyObject *span_exit(NativeSpan *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__ takes 3 arguments");
        return NULL;
    }
    if (self->token != NULL) {
        PyObject *token = self->token;
        self->token = NULL;
        int failed = PyContextVar_Reset(g_current, token);
        Py_DECREF(token);
        if (failed < 0) return NULL;
    }
    if (args[1] != Py_None && self->recording && set_error_type(self, args[1]) < 0) return NULL;
    if (span_finish(self) < 0) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *span_set_attribute(NativeSpan *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_attribute takes a key and a value");
        return NULL;
    }
    PyObject *attributes = self->recording ? held_attributes(self) : NULL;
    if (attributes != NULL) {
        int failed = PyDict_SetItem(attributes, args[0], args[1]);
        Py_DECREF(attributes);
        if (failed < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *span_set_attributes(NativeSpan *self, PyObject *update) {
    PyObject *attributes = self->recording ? held_attributes(self) : NULL;
    if (attributes != NULL) {
        /* dict.update's rules: a dict merged at once, any other mapping or pairs as dict.update takes them */
        PyObject *r = PyDict_CheckExact(update) ? (PyDict_Update(attributes, update) < 0 ? NULL : Py_NewRef(Py_None))
                                                : PyObject_CallMethod(attributes, "update", "O", update);
        Py_DECREF(attributes);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *span_fail(NativeSpan *self, PyObject *error) {
    if (self->recording && set_error_type(self, error) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *span_is_recording(NativeSpan *self, PyObject *unused) {
    return PyBool_FromLong(self->recording && !self->end_ns);
}

static PyObject *get_trace_id(NativeSpan *self, void *closure) {
    PyObject *high = PyLong_FromUnsignedLongLong(self->trace_high);
    if (high == NULL) return NULL;
    PyObject *shifted = PyNumber_Lshift(high, s_shift64);
    Py_DECREF(high);
    if (shifted == NULL) return NULL;
    PyObject *low = PyLong_FromUnsignedLongLong(self->trace_low);
    if (low == NULL) {
        Py_DECREF(shifted);
        return NULL;
    }
    PyObject *id = PyNumber_Or(shifted, low);
    Py_DECREF(shifted);
    Py_DECREF(low);
    return id;
}

static PyObject *get_span_id(NativeSpan *self, void *closure) { return PyLong_FromUnsignedLongLong(self->span_id); }

static PyObject *get_parent_id(NativeSpan *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->parent_id);
}

static PyObject *get_start_ns(NativeSpan *self, void *closure) { return PyLong_FromUnsignedLongLong(self->start_ns); }

static PyObject *get_end_ns(NativeSpan *self, void *closure) { return PyLong_FromUnsignedLongLong(self->end_ns); }

static PyObject *get_recording(NativeSpan *self, void *closure) { return PyBool_FromLong(self->recording); }

static PyObject *get_kind(NativeSpan *self, void *closure) { return PyLong_FromLong(self->kind); }

static PyObject *get_remote_parent(NativeSpan *self, void *closure) {
    return PyBool_FromLong(self->kind == KIND_SERVER && self->parent_id != 0);
}

static PyObject *get_error(NativeSpan *self, void *closure) {
    PyObject *attributes = held_attributes(self);
    if (attributes == NULL) Py_RETURN_NONE;
    PyObject *error = PyDict_GetItemWithError(attributes, s_error_type);
    Py_XINCREF(error);
    Py_DECREF(attributes);
    if (error == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return error;
}

static PyObject *get_traceparent(NativeSpan *self, void *closure) {
    char text[64];
    snprintf(text, sizeof text, "00-%016llx%016llx-%016llx-%s", (unsigned long long)self->trace_high,
             (unsigned long long)self->trace_low, (unsigned long long)self->span_id,
             self->recording ? "01" : "00");
    return PyUnicode_FromString(text);
}

static PyObject *get_object(PyObject **slot) {
    Py_INCREF(*slot);
    return *slot;
}

static PyObject *get_name(NativeSpan *self, void *closure) { return get_object(&self->name); }

static PyObject *get_tracestate(NativeSpan *self, void *closure) { return get_object(&self->tracestate); }

static PyObject *get_attributes(NativeSpan *self, void *closure) {
    return self->attributes != NULL ? get_object(&self->attributes) : PyDict_New();
}

static int set_attributes_dict(NativeSpan *self, PyObject *value, void *closure) {
    if (value == NULL || !PyDict_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "span attributes must be a dict");
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(self->attributes, value);
    return 0;
}

static PyGetSetDef span_getset[] = {
    {"name", (getter)get_name, NULL, NULL, NULL},
    {"trace_id", (getter)get_trace_id, NULL, NULL, NULL},
    {"span_id", (getter)get_span_id, NULL, NULL, NULL},
    {"parent_id", (getter)get_parent_id, NULL, NULL, NULL},
    {"recording", (getter)get_recording, NULL, NULL, NULL},
    {"attributes", (getter)get_attributes, (setter)set_attributes_dict, NULL, NULL},
    {"kind", (getter)get_kind, NULL, NULL, NULL},
    {"tracestate", (getter)get_tracestate, NULL, NULL, NULL},
    {"start_ns", (getter)get_start_ns, NULL, NULL, NULL},
    {"end_ns", (getter)get_end_ns, NULL, NULL, NULL},
    {"remote_parent", (getter)get_remote_parent, NULL, "Whether the parent is another process's span.", NULL},
    {"error", (getter)get_error, NULL, NULL, NULL},
    {"traceparent", (getter)get_traceparent, NULL, NULL, NULL},
    {NULL},
};

static PyMethodDef span_methods[] = {
    {"__enter__", (PyCFunction)span_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL, NULL},
    {"end", (PyCFunction)span_end, METH_NOARGS, "End the span (once) and hand it on if sampled."},
    {"set_attribute", (PyCFunction)(void (*)(void))span_set_attribute, METH_FASTCALL, NULL},
    {"set_attributes", (PyCFunction)span_set_attributes, METH_O, NULL},
    {"fail", (PyCFunction)span_fail, METH_O, "Mark the span failed with the error's type."},
    {"is_recording", (PyCFunction)span_is_recording, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject NativeSpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fleetgate_native.Span",
    .tp_doc = "A span of a trace, in C (the interface of fleetgate.tracing.Span).",
    .tp_basicsize = sizeof(NativeSpan),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = span_tp_new,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_methods = span_methods,
    .tp_getset = span_getset,
};

/* child(name, **attributes): a span under the current one, or the no-op when there is none to record */
static PyObject *native_child(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "child() takes the span's name (a str) and keyword attributes");
        return NULL;
    }
    if (g_current == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native tracing is not bound");
        return NULL;
    }
    PyObject *parent;
    if (PyContextVar_Get(g_current, NULL, &parent) < 0) return NULL;
    if (parent == NULL || parent == Py_None) {
        Py_XDECREF(parent);
        Py_INCREF(g_null);
        return g_null;
    }
    if (!NativeSpan_Check(parent)) { /* a Python span, begun before the switch: the Python child */
        Py_DECREF(parent);
        return PyObject_Vectorcall(g_python_child, args, nargs, kwnames);
    }
    NativeSpan *p = (NativeSpan *)parent;
    if (!p->recording) {
        Py_DECREF(parent);
        Py_INCREF(g_null);
        return g_null;
    }
    PyObject *attributes = PyDict_New();
    if (attributes == NULL) {
        Py_DECREF(parent);
        return NULL;
    }
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyDict_SetItem(attributes, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            Py_DECREF(attributes);
            Py_DECREF(parent);
            return NULL;
        }
    }
    NativeSpan *span = span_new(args[0], p->trace_high, p->trace_low, p->span_id, 1, attributes, KIND_INTERNAL,
                                p->tracestate);
    Py_DECREF(attributes);
    Py_DECREF(parent);
    return (PyObject *)span;
}

/* A request's root span (tracing.start_span's rules): under the client's trace when `context` is a
 * RemoteParent (its ids, decision and tracestate), else a new trace sampled by the bound. Returns
 * `when_off` while no sink is set. */
static PyObject *start_root(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject *when_off) {
    PyObject *name = nargs >= 1 ? args[0] : NULL, *context = nargs >= 2 ? args[1] : NULL;
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    /* `name` and `context` bind by keyword too, as in the Python start_span(name, context=None,
     * **attributes): a client's context passed so must not become an attribute of a new trace */
    Py_ssize_t name_at = -1, context_at = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        Py_ssize_t length = PyUnicode_GET_LENGTH(key);
        if (length != 4 && length != 7) continue; /* an attribute's dotted name: one length check */
        int is_name = PyUnicode_CompareWithASCIIString(key, "name") == 0;
        if (!is_name && PyUnicode_CompareWithASCIIString(key, "context") != 0) continue;
        if ((is_name ? name : context) != NULL) {
            PyErr_Format(PyExc_TypeError, "start_span() got multiple values for argument '%U'", key);
            return NULL;
        }
        if (is_name) {
            name = args[nargs + i];
            name_at = i;
        } else {
            context = args[nargs + i];
            context_at = i;
        }
    }
    if (nargs > 2 || name == NULL || !PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "start_span() takes the span's name (a str), a context and keyword attributes");
        return NULL;
    }
    if (g_sink == NULL && g_queue == NULL) return Py_NewRef(when_off);
    if (context == NULL) context = Py_None;
    if (context != Py_None && (!PyTuple_Check(context) || PyTuple_GET_SIZE(context) != 4)) {
        PyErr_SetString(PyExc_TypeError, "the context must be a RemoteParent or None");
        return NULL;
    }
    uint64_t high, low, parent = 0;
    int sampled;
    PyObject *tracestate = s_empty;
    if (context != Py_None) {
        PyObject *trace_id = PyTuple_GET_ITEM(context, 0);
        low = PyLong_AsUnsignedLongLongMask(trace_id);
        if (low == (uint64_t)-1 && PyErr_Occurred()) return NULL;
        PyObject *high_obj = PyNumber_Rshift(trace_id, s_shift64);
        if (high_obj == NULL) return NULL;
        high = PyLong_AsUnsignedLongLongMask(high_obj);
        Py_DECREF(high_obj);
        if (high == (uint64_t)-1 && PyErr_Occurred()) return NULL;
        parent = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(context, 1));
        if (parent == (uint64_t)-1 && PyErr_Occurred()) return NULL;
        sampled = PyObject_IsTrue(PyTuple_GET_ITEM(context, 2));
        if (sampled < 0) return NULL;
        tracestate = PyTuple_GET_ITEM(context, 3);
        if (!PyUnicode_Check(tracestate)) {
            PyErr_SetString(PyExc_TypeError, "the context's tracestate must be a str");
            return NULL;
        }
    } else {
        high = next_id();
        low = next_id();
        sampled = g_sample_all || low < g_sample_bound;
    }
    PyObject *attributes = PyDict_New();
    if (attributes == NULL) return NULL;
    /* an unsampled new trace keeps no attributes (as the Python start_span) */
    if (context == Py_None && !sampled) count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i == name_at || i == context_at) continue;
        if (PyDict_SetItem(attributes, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            Py_DECREF(attributes);
            return NULL;
        }
    }
    NativeSpan *span = span_new(name, high, low, parent, sampled, attributes, KIND_SERVER, tracestate);
    Py_DECREF(attributes);
    return (PyObject *)span;
}

static PyObject *native_start_span(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return start_root(args, nargs, kwnames, Py_None);
}

static PyObject *native_span(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (g_null == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native tracing is not bound");
        return NULL;
    }
    return start_root(args, nargs, kwnames, g_null);
}

/* set_sample_bound(bound): new traces are kept when their id's low 64 bits are below it (2**64: all) */
static PyObject *native_set_sample_bound(PyObject *module, PyObject *bound) {
    if (!PyLong_Check(bound)) {
        PyErr_SetString(PyExc_TypeError, "the bound must be an int");
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) return NULL;
    int negative = PyObject_RichCompareBool(bound, zero, Py_LT);
    Py_DECREF(zero);
    if (negative < 0) return NULL;
    if (negative) {
        PyErr_SetString(PyExc_ValueError, "the bound must not be negative");
        return NULL;
    }
    PyObject *above = PyNumber_Rshift(bound, s_shift64);
    if (above == NULL) return NULL;
    int at_least_all = PyObject_IsTrue(above);
    Py_DECREF(above);
    if (at_least_all < 0) return NULL;
    if (at_least_all) {
        g_sample_all = 1;
        Py_RETURN_NONE;
    }
    uint64_t value = PyLong_AsUnsignedLongLong(bound);
    if (value == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    g_sample_bound = value;
    g_sample_all = 0;
    Py_RETURN_NONE;
}

/* bind(current, null, python_child, seed) */
static PyObject *native_bind(PyObject *module, PyObject *args) {
    PyObject *current, *null, *python_child;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "O!OOK:bind", &PyContextVar_Type, &current, &null, &python_child, &seed)) return NULL;
    Py_INCREF(current);
    Py_XSETREF(g_current, current);
    Py_INCREF(null);
    Py_XSETREF(g_null, null);
    Py_INCREF(python_child);
    Py_XSETREF(g_python_child, python_child);
    g_rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
    Py_RETURN_NONE;
}

static void clear_sink(void) {
    Py_CLEAR(g_sink);
    Py_CLEAR(g_queue);
    Py_CLEAR(g_append);
    Py_CLEAR(g_wake);
    Py_CLEAR(g_on_full);
    Py_CLEAR(g_on_unencodable);
}

/* set_sink(sink=None, queue=None, max_queued=0, batch_size=0, wake=None, on_full=None, on_unencodable=None) */
static PyObject *native_set_sink(PyObject *module, PyObject *args, PyObject *kwargs) {
    PyObject *sink = Py_None, *queue = Py_None, *wake = Py_None, *on_full = Py_None, *on_unencodable = Py_None;
    Py_ssize_t max_queued = 0, batch_size = 0;
    static char *names[] = {"sink", "queue", "max_queued", "batch_size", "wake", "on_full", "on_unencodable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OOnnOOO:set_sink", names, &sink, &queue, &max_queued,
                                     &batch_size, &wake, &on_full, &on_unencodable))
        return NULL;
    if (queue != Py_None && (!PyCallable_Check(wake) || !PyCallable_Check(on_full) ||
                             !PyCallable_Check(on_unencodable) || max_queued < 1 || batch_size < 1)) {
        PyErr_SetString(PyExc_ValueError, "a queue needs max_queued, batch_size, wake, on_full and on_unencodable");
        return NULL;
    }
    if (sink != Py_None && !PyCallable_Check(sink)) {
        PyErr_SetString(PyExc_TypeError, "sink must be callable");
        return NULL;
    }
    PyObject *append = NULL;
    if (queue != Py_None && (append = PyObject_GetAttrString(queue, "append")) == NULL) return NULL;
    clear_sink();
    if (queue != Py_None) {
        Py_INCREF(queue);
        g_queue = queue;
        g_append = append;
        Py_INCREF(wake);
        g_wake = wake;
        Py_INCREF(on_full);
        g_on_full = on_full;
        Py_INCREF(on_unencodable);
        g_on_unencodable = on_unencodable;
        g_max_queued = max_queued;
        g_batch_size = batch_size;
    } else if (sink != Py_None) {
        Py_INCREF(sink);
        g_sink = sink;
    }
    Py_RETURN_NONE;
}

#define SPAN_NATIVE_METHODS                                                                          \
    {"child", (PyCFunction)(void (*)(void))native_child, METH_FASTCALL | METH_KEYWORDS,             \
     "A span under the current one, or a no-op when there is nothing to record."},                  \
    {"bind", native_bind, METH_VARARGS, "bind(current, null, python_child, seed)"},                   \
    {"set_sink", (PyCFunction)(void (*)(void))native_set_sink, METH_VARARGS | METH_KEYWORDS,         \
     "Where ended, sampled spans go: nowhere, a callable, or a batch exporter's queue."},             \
    {"start_span", (PyCFunction)(void (*)(void))native_start_span, METH_FASTCALL | METH_KEYWORDS,   \
     "A request's root span, started (None while no sink is set)."},                                 \
    {"span", (PyCFunction)(void (*)(void))native_span, METH_FASTCALL | METH_KEYWORDS,               \
     "A request's root span as a context manager (the no-op while no sink is set)."},              \
    {"set_sample_bound", native_set_sample_bound, METH_O, "set_sample_bound(bound)"},

static int span_native_init(PyObject *module) {
    if (PyType_Ready(&NativeSpanType) < 0) return -1;
    if (s_empty == NULL && (s_empty = PyUnicode_InternFromString("")) == NULL) return -1;
    Py_INCREF(&NativeSpanType);
    if (PyModule_AddObject(module, "Span", (PyObject *)&NativeSpanType) < 0) {
        Py_DECREF(&NativeSpanType);
        return -1;
    }
    return 0;
}
