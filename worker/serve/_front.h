// The C front's shared parts: its state (Front), connections, requests and batches; what _front.c (HTTP/1.1, the
// queue and the Python type) and _front_grpc.c (gRPC over HTTP/2) give each other.
#ifndef TANDEM_FRONT_H
#define TANDEM_FRONT_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "_front_answer.h"

#define MAX_DIMS 8
#define SWEEP_MS 20            // deadlines and idle connections are looked at this often
#define RETRY_AFTER "1"

typedef struct request request_t;
typedef struct h2 h2_t;          // an HTTP/2 (gRPC) connection's state: _front_grpc.c
typedef struct stream stream_t;  // one of its calls

typedef struct connection {
    int fd;
    int closed;
    int reading;               // EPOLLIN is watched (paused while the input holds more than one request can)
    int writing;               // EPOLLOUT is watched
    int closing;               // closed once its answers are written (the server drains): no request taken meanwhile
    int dirty;                 // answers appended, to be flushed at the end of the batch (gRPC)
    int requests;              // requests taken from it (HTTP/1.1), and as the last sweep saw them
    int swept_requests;
    int64_t partial_since;     // the sweep saw a partial request from then on (HTTP/1.1; 0: none)
    h2_t *h2;                  // a gRPC connection's HTTP/2 state; NULL for HTTP/1.1
    request_t *current;        // the request in flight (one at a time; later ones wait in `in`)
    int64_t last_activity;
    struct connection *prev, *next;  // all open connections, for the sweeps
    struct connection *next_released;
    char *in;
    size_t in_len, in_cap;
    char *out;
    size_t out_len, out_cap;
} connection_t;

struct request {
    request_t *next;           // in the queue
    connection_t *connection;  // NULL once answered or abandoned while a worker holds it
    stream_t *stream;          // a gRPC call's stream (NULL over HTTP/1.1)
    int64_t arrived, deadline; // CLOCK_MONOTONIC ns (time.perf_counter_ns, time.monotonic_ns)
    int rows;
    int taken;                 // in a worker's batch
    char *id;                  // the request's id: over HTTP its JSON string with the quotes; over gRPC its bytes
    size_t id_len;
    float x[];                 // rows x features
};

typedef struct batch {
    struct batch *next;
    int n, rows;
    int status;                // 200: outputs in y; else the error status and message
    char *message;
    size_t message_len;
    int out_dims;
    long out_shape[MAX_DIMS];  // per example
    long out_features;
    float *y;
    request_t *requests[];
} batch_t;

typedef struct {
    PyObject_HEAD
    // Set at construction, read by every thread.
    char *infer_path;
    size_t infer_path_len;
    char *input_name;
    size_t input_name_len;
    int dims;
    long shape[MAX_DIMS];      // per example
    long features;
    char *model_name, *version;
    size_t model_name_len, version_len;
    char *output_name;
    size_t output_name_len;
    int epoll_fd, wake_fd, handed_fd, want_fd;
    // Under lock.
    pthread_mutex_t lock;
    char *token;               // NULL: no token asked
    size_t token_len;
    char *token_path;          // the file it was read from, and its (mtime ns, size) then: a file changed since is
    long long token_mtime_ns, token_size;  // the Python server's to read again (the token may have been rotated)
    long max_body;
    long max_message;          // a gRPC request's message, at most
    // The limits (worker/serve/limits.py's Limits, given by Python; configure() changes them, connections opened
    // after it see the HTTP/2 settings and flood limits).
    long max_head, max_streams, stream_window, connection_window, connection_buffer, process_buffer;
    long unsent_bytes;         // answers a client leaves unread: no more of its input read meanwhile
    int64_t header_timeout_ns, body_timeout_ns;
    long reset_burst, resets_per_second, max_continuations, max_owed_acks, max_settings;
    size_t held;               // gRPC request bytes buffered, every connection together (the I/O thread's; atomic)
    int serving;               // serve_model() was called: the model's fields are set (atomic, release/acquire)
    long max_rows;             // examples one request may carry (the model's max_batch_size)
    int queue_limit;
    int64_t timeout_ns;
    int64_t idle_timeout_ns;
    int draining;              // new requests are answered 503
    int stopping;              // run() returns
    char *stop_message;        // the 503 of requests unanswered at stop
    char *queue_full;          // the 429's message at this queue limit (errors.queue_full_message)
    unsigned char grpc_codes[200];  // the gRPC status code of each HTTP status 400-599 (grpc_protocol.status_code)
    request_t *queue_head, *queue_tail;
    int queued, queued_rows;
    int others;                // requests queued in ParallelInference's own queue: queueLimit counts both
    int want_rows;             // wake the workers (want_fd) once this many rows are queued (0: no one waits)
    batch_t *answered_head, *answered_tail;
    struct handed { int fd; char *data; size_t len; struct handed *next; } *handed_head;
    struct adopted { int fd, grpc; struct adopted *next; } *adopted_head;  // for the I/O thread to watch
    struct call *calls_head;   // gRPC calls for the Python server (calls()), newest first
    struct call_answer *call_answers_head;  // its answers (answer_call), for the I/O thread to write
    uint64_t next_serial;      // the I/O thread's: names a gRPC connection to the Python server
    long long success, failed, rejected, pending, expired, aborted;
    long long expired_ns, aborted_ns;
    // The I/O thread's own.
    connection_t *connections;
    connection_t *released;
    int running;
} Front;

// A gRPC call for the Python server: its connection's serial, its stream, its headers and its body (the
// length-prefixed message as received); or word that such a call is cancelled.
struct call {
    struct call *next;
    uint64_t serial;
    uint32_t stream;
    int cancelled;             // no headers or body: word that the call is cancelled
    char *fields;              // (u32 length, name, u32 length, value) each, as decoded
    size_t fields_len;
    char *body;
    size_t body_len;
};

// The Python server's answer to a call: its gRPC status code and message, and for an OK its length-prefixed
// message (data; NULL: a trailers-only answer).
struct call_answer {
    struct call_answer *next;
    uint64_t serial;
    uint32_t stream;
    int code;
    char *message, *data;
    size_t message_len, data_len;
};

// Take the list at f->field, which other threads push onto newest first under f->lock, into `taken`, oldest first.
#define TAKE_IN_ORDER(f, field, type, taken) do {  \
        pthread_mutex_lock(&(f)->lock);             \
        type *pushed_ = (f)->field;                 \
        (f)->field = NULL;                          \
        pthread_mutex_unlock(&(f)->lock);           \
        (taken) = NULL;                             \
        while (pushed_) {                           \
            type *next_ = pushed_->next;            \
            pushed_->next = (taken);                \
            (taken) = pushed_;                      \
            pushed_ = next_;                        \
        }                                           \
    } while (0)

// _front.c
int64_t now_ns(void);
void *grown(void *memory, size_t size);
char *copied(const char *s, size_t len);
void signal_fd(int fd);
void watch_events(Front *f, connection_t *c);
void append(connection_t *c, const char *bytes, size_t n);
int flush(Front *f, connection_t *c);
void close_connection(Front *f, connection_t *c);
void abandon(Front *f, request_t *r);
int enqueue(Front *f, request_t *r, int64_t limit_ns, char *why, size_t why_cap, int *why_len);
int token_matches(Front *f, const char *value, size_t len);
void free_request(request_t *r);
void expire(Front *f, request_t *r, int64_t now);
answer_t answer_of(Front *f, request_t *r, batch_t *b, long offset);

// _front_grpc.c
void h2_start(Front *f, connection_t *c);
void h2_readable(Front *f, connection_t *c);
void h2_writable(Front *f, connection_t *c);
void h2_answer(Front *f, request_t *r, batch_t *b, long offset);
void h2_answer_error(Front *f, request_t *r, int status, const char *message, size_t len);
void h2_sweep(Front *f, connection_t *c, int64_t now);
void h2_stop(Front *f, connection_t *c, const char *message, size_t len);
void h2_release(Front *f, connection_t *c);
void h2_detach(stream_t *s);
void h2_write_call_answers(Front *f);
void free_call(struct call *call);
void free_call_answer(struct call_answer *answer);
int h2_init(void);

// Answers a client may leave unread before its input is no longer read (Limits.unsent_bytes).
static inline size_t unsent_limit(Front *f) { return __atomic_load_n(&f->unsent_bytes, __ATOMIC_RELAXED); }

#endif
