// _native_server: the request path of bench/native_server.py in C, so that no Python runs per request.
//
// A benchmark's instrument, not part of tandem: it measures how much of the raw forward any server keeps on these
// cores once the interpreter's per-request work is gone (bench_inference.py --only native). It serves exactly what the
// benchmark sends and no more: HTTP/1.1 keep-alive with Content-Length bodies, one request at a time per connection;
// a POST's body is an Open Inference Protocol JSON request whose first "data" array holds FEATURES numbers, and its
// answer carries CLASSES FP32 numbers; any GET is answered 200 {"ready":true} (the harness's readiness probe);
// anything else is answered 400 and closed.
//
// run() runs the I/O loop on the calling thread, without the GIL, until the process ends: epoll over the connections,
// parsing, decoding a request's numbers into the queue, writing answers. adopt(fd) adds a connection accepted
// elsewhere (the supervisor's). A Python worker thread calls take(limit) (up to `limit` queued examples as one float32 buffer and
// a handle; None after 50 ms with none) and give(handle, outputs), once per batch.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FEATURES 64  // the digits MLP's input and output
#define CLASSES 10
#define QUEUE_LIMIT 4096
#define MAX_BATCH 256
#define MAX_HEAD 65536
#define MAX_BODY (1 << 20)
#define MAX_UNSENT 65536  // answers waiting for a client that does not read: no more requests taken from it meanwhile

typedef struct connection {
    int fd;
    int closed;
    int in_flight;  // a request of this connection is queued or in a forward: freed when its answer comes
    int waiting_to_write;  // watched for EPOLLOUT
    struct connection *next_released;
    char *in;
    size_t in_len, in_cap;
    char *out;
    size_t out_len, out_cap;
} connection_t;

typedef struct {
    connection_t *connection;
    float x[FEATURES];
} example_t;

typedef struct batch {
    int n;
    connection_t *connections[MAX_BATCH];
    float y[MAX_BATCH * CLASSES];
    struct batch *next;
} batch_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queued_cond = PTHREAD_COND_INITIALIZER;
static example_t queue[QUEUE_LIMIT];
static int queue_head, queue_len;
static batch_t *answered_head, *answered_tail;
static int epoll_fd = -1, wake_fd = -1;

static void *grown(void *memory, size_t size) {
    void *bigger = realloc(memory, size);
    if (bigger == NULL) {
        fputs("_native_server: out of memory\n", stderr);
        abort();
    }
    return bigger;
}

static const char BAD_REQUEST[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
static const char READY[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n"
                            "{\"ready\":true}";

static connection_t *released;  // freed after the events of one epoll_wait: a later one may name them

static void release(connection_t *c) {
    c->next_released = released;
    released = c;
}

static void free_released(void) {
    while (released) {
        connection_t *c = released;
        released = c->next_released;
        free(c->in);
        free(c->out);
        free(c);
    }
}

static void close_connection(connection_t *c) {
    if (c->closed) return;
    c->closed = 1;
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    if (!c->in_flight) release(c);
}

static void append(connection_t *c, const char *bytes, size_t n) {
    if (c->out_len + n > c->out_cap) {
        c->out_cap = (c->out_len + n) * 2;
        c->out = grown(c->out, c->out_cap);
    }
    memcpy(c->out + c->out_len, bytes, n);
    c->out_len += n;
}

// Write what is buffered; what the socket does not take waits for EPOLLOUT. -1: the connection failed.
static int flush(connection_t *c) {
    size_t written = 0;
    while (written < c->out_len) {
        ssize_t k = write(c->fd, c->out + written, c->out_len - written);
        if (k < 0) {
            if (errno == EAGAIN) break;
            return -1;
        }
        written += k;
    }
    memmove(c->out, c->out + written, c->out_len - written);
    c->out_len -= written;
    int waiting = c->out_len > 0;
    if (waiting != c->waiting_to_write) {
        c->waiting_to_write = waiting;
        struct epoll_event event = {.events = EPOLLIN | (waiting ? EPOLLOUT : 0), .data.ptr = c};
        epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c->fd, &event);
    }
    return 0;
}

static void refuse(connection_t *c) {
    append(c, BAD_REQUEST, sizeof BAD_REQUEST - 1);
    flush(c);
    close_connection(c);
}

// The request at the front of the connection's input: 1 taken (queued or answered), 0 incomplete, -1 malformed.
static int take_request(connection_t *c) {
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (!end) return c->in_len > MAX_HEAD ? -1 : 0;
    size_t head = end + 4 - c->in;
    long length = 0;
    for (char *line = memchr(c->in, '\n', head); line && line < end; line = memchr(line + 1, '\n', end - line)) {
        if (strncasecmp(line + 1, "content-length:", 15) == 0) length = strtol(line + 16, NULL, 10);
    }
    if (length < 0 || length > MAX_BODY) return -1;
    if (c->in_len < head + (size_t)length) return 0;
    int get = strncmp(c->in, "GET ", 4) == 0;
    example_t example = {.connection = c};
    if (!get) {
        if (strncmp(c->in, "POST ", 5) != 0) return -1;
        char *body = c->in + head, *stop = body + length;
        char *data = memmem(body, length, "\"data\"", 6);
        if (!data) return -1;
        char *p = data + 6;
        while (p < stop && (*p == ' ' || *p == ':')) p++;
        if (p >= stop || *p != '[') return -1;
        p++;
        char after = *stop;  // the buffer has a byte to spare past its data: strtof stops at the body's end
        *stop = 0;
        for (int i = 0; i < FEATURES; i++) {
            char *next;
            example.x[i] = strtof(p, &next);  // stops at the terminator put at the body's end, at the latest
            int read_one = next != p;
            p = next;
            while (p < stop && *p == ' ') p++;
            if (!read_one || p >= stop || *p != (i < FEATURES - 1 ? ',' : ']')) {
                *stop = after;
                return -1;
            }
            p++;
        }
        *stop = after;
    }
    size_t used = head + length;
    memmove(c->in, c->in + used, c->in_len - used);
    c->in_len -= used;
    if (get) {
        append(c, READY, sizeof READY - 1);
        return flush(c) < 0 ? -1 : 1;
    }
    pthread_mutex_lock(&lock);
    if (queue_len == QUEUE_LIMIT) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    queue[(queue_head + queue_len) % QUEUE_LIMIT] = example;
    queue_len++;
    c->in_flight = 1;
    pthread_cond_signal(&queued_cond);
    pthread_mutex_unlock(&lock);
    return 1;
}

// Take requests from the connection's input while none of its requests is in flight (GETs are answered at once) and
// its client reads its answers.
static void take_requests(connection_t *c) {
    while (!c->closed && !c->in_flight && c->in_len && c->out_len < MAX_UNSENT) {
        int taken = take_request(c);
        if (taken < 0) refuse(c);
        if (taken <= 0) return;
    }
}

static void readable(connection_t *c) {
    if (c->in_cap - c->in_len < 4096) {
        c->in_cap = c->in_cap * 2 + 4096;
        c->in = grown(c->in, c->in_cap + 1);
    }
    ssize_t k = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
    if (k == 0 || (k < 0 && errno != EAGAIN)) {
        close_connection(c);
        return;
    }
    if (k > 0) c->in_len += k;
    if (c->in_len > MAX_HEAD + MAX_BODY) {  // more sent ahead than one request can hold, while one is in flight
        refuse(c);
        return;
    }
    take_requests(c);
}

static void answer(batch_t *b) {
    for (int i = 0; i < b->n; i++) {
        connection_t *c = b->connections[i];
        c->in_flight = 0;
        if (c->closed) {
            release(c);
            continue;
        }
        char body[512], head[128];
        int n = snprintf(body, sizeof body,
                         "{\"model_name\":\"mlp\",\"model_version\":\"1\",\"outputs\":[{\"name\":\"output\","
                         "\"datatype\":\"FP32\",\"shape\":[1,%d],\"data\":[", CLASSES);
        const float *y = b->y + i * CLASSES;
        for (int j = 0; j < CLASSES; j++) n += snprintf(body + n, sizeof body - n, j ? ",%.9g" : "%.9g", y[j]);
        n += snprintf(body + n, sizeof body - n, "]}]}");
        int h = snprintf(head, sizeof head,
                         "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", n);
        append(c, head, h);
        append(c, body, n);
        if (flush(c) < 0) {
            close_connection(c);
            continue;
        }
        take_requests(c);
    }
    free(b);
}

static void watch(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    connection_t *c = grown(NULL, sizeof *c);
    memset(c, 0, sizeof *c);
    c->fd = fd;
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &event);
}

static void serve_forever(void) {
    struct epoll_event events[512];
    for (;;) {
        int n = epoll_wait(epoll_fd, events, 512, -1);
        if (n < 0 && errno != EINTR) return;
        for (int i = 0; i < n; i++) {
            void *what = events[i].data.ptr;
            if (what == &wake_fd) {
                uint64_t count;
                if (read(wake_fd, &count, sizeof count) < 0 && errno != EAGAIN) return;
                pthread_mutex_lock(&lock);
                batch_t *b = answered_head;
                answered_head = answered_tail = NULL;
                pthread_mutex_unlock(&lock);
                while (b) {
                    batch_t *next = b->next;
                    answer(b);
                    b = next;
                }
                continue;
            }
            connection_t *c = what;
            if (c->closed) continue;  // closed by an earlier event of this wait
            if (events[i].events & EPOLLOUT) {
                if (flush(c) < 0) {
                    close_connection(c);
                    continue;
                }
                take_requests(c);
            }
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) readable(c);
        }
        free_released();
    }
}

static int ensure_started(void) {
    if (epoll_fd >= 0) return 0;
    epoll_fd = epoll_create1(0);
    wake_fd = eventfd(0, EFD_NONBLOCK);
    if (epoll_fd < 0 || wake_fd < 0) return -1;
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = &wake_fd};
    return epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &event);
}

// run(): serve until the process ends.
static PyObject *run(PyObject *self, PyObject *args) {
    if (ensure_started() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_BEGIN_ALLOW_THREADS
    serve_forever();
    Py_END_ALLOW_THREADS
    return PyErr_SetFromErrno(PyExc_OSError);
}

// adopt(fd): serve a connection accepted elsewhere (non-blocking; this module closes it).
static PyObject *adopt(PyObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (ensure_started() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    watch(fd);
    Py_RETURN_NONE;
}

// take(limit) -> (bytearray: n x FEATURES float32, n, handle) or None when nothing was queued for 50 ms.
static PyObject *take(PyObject *self, PyObject *args) {
    int limit;
    if (!PyArg_ParseTuple(args, "i", &limit)) return NULL;
    if (limit < 1 || limit > MAX_BATCH) return PyErr_Format(PyExc_ValueError, "limit must be 1 to %d", MAX_BATCH);
    PyObject *x = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)limit * FEATURES * sizeof(float));
    batch_t *b = x == NULL ? NULL : malloc(sizeof *b);
    if (b == NULL) {
        Py_XDECREF(x);
        return PyErr_NoMemory();
    }
    float *into = (float *)PyByteArray_AS_STRING(x);
    Py_BEGIN_ALLOW_THREADS
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 50000000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&lock);
    while (queue_len == 0 && pthread_cond_timedwait(&queued_cond, &lock, &until) == 0) {}
    b->n = queue_len < limit ? queue_len : limit;
    for (int i = 0; i < b->n; i++) {
        example_t *example = &queue[(queue_head + i) % QUEUE_LIMIT];
        b->connections[i] = example->connection;
        memcpy(into + i * FEATURES, example->x, sizeof example->x);
    }
    queue_head = (queue_head + b->n) % QUEUE_LIMIT;
    queue_len -= b->n;
    pthread_mutex_unlock(&lock);
    Py_END_ALLOW_THREADS
    if (b->n == 0) {
        free(b);
        Py_DECREF(x);
        Py_RETURN_NONE;
    }
    if (b->n < limit && PyByteArray_Resize(x, (Py_ssize_t)b->n * FEATURES * sizeof(float)) < 0) {
        Py_DECREF(x);
        return NULL;  // the batch's connections stay in flight: native_server.py ends the process on any error
    }
    return Py_BuildValue("NiK", x, b->n, (unsigned long long)(uintptr_t)b);
}

// give(handle, outputs): a buffer of n x CLASSES float32 for the batch `take` handed out as `handle`.
static PyObject *give(PyObject *self, PyObject *args) {
    unsigned long long handle;
    Py_buffer y;
    if (!PyArg_ParseTuple(args, "Ky*", &handle, &y)) return NULL;
    batch_t *b = (batch_t *)(uintptr_t)handle;
    size_t size = (size_t)b->n * CLASSES * sizeof(float);
    if ((size_t)y.len != size) {
        PyBuffer_Release(&y);
        return PyErr_Format(PyExc_ValueError, "outputs of %zd bytes for a batch of %d (%zu bytes)", y.len, b->n, size);
    }
    memcpy(b->y, y.buf, size);
    PyBuffer_Release(&y);
    b->next = NULL;
    pthread_mutex_lock(&lock);
    if (answered_tail) answered_tail->next = b;
    else answered_head = b;
    answered_tail = b;
    pthread_mutex_unlock(&lock);
    uint64_t one = 1;
    if (write(wake_fd, &one, sizeof one) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", run, METH_NOARGS, "run(): serve on the calling thread until the process ends"},
    {"adopt", adopt, METH_VARARGS, "adopt(fd): serve a connection accepted elsewhere"},
    {"take", take, METH_VARARGS, "take(limit): (examples, n, handle), or None after 50 ms with none queued"},
    {"give", give, METH_VARARGS, "give(handle, outputs): the batch's outputs, to be answered"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_native_server", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__native_server(void) { return PyModule_Create(&module); }
