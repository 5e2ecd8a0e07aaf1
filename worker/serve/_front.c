// tandem.worker.serve._front: the HTTP port's common inference request served without the interpreter.
//
// A Front owns the connections of a server's HTTP port. On its own thread (run(), without the GIL) it reads them,
// and a request of the one shape it knows, an Open Inference Protocol JSON infer request for the served model
// (`POST /v2/models/<name>/infer`, a Content-Length body, one FP32 input of the model's per-example shape, its
// numbers in a flat "data" list), is parsed here into a queue of examples; ParallelInference's workers take them
// from the queue as part of their batches (take) and give back the outputs (give, fail), which this thread writes as
// JSON answers. Anything else (another endpoint, binary tensors, chunked or compressed bodies, parameters, a token
// that is not the one it holds, a malformed request) is never answered here: once the connection has no request in
// flight it is handed over, with the bytes read from it, to the Python HTTP server (handed()), which then serves it
// to the end exactly as it serves every other connection. So the Python server stays the one place where requests
// are validated and errors explained; this file only decides "mine, exactly" or "not mine".
//
// What this thread answers on its own: its requests' outputs (200), a full queue (429), a request past the pool's
// timeout (504), a server draining or stopped (503), a failed forward (the status and message Python gives).
#include "_front.h"
#include "_front_parse.h"

int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void *grown(void *memory, size_t size) {
    void *bigger = realloc(memory, size);
    if (bigger == NULL) {
        fputs("tandem _front: out of memory\n", stderr);
        abort();
    }
    return bigger;
}

char *copied(const char *s, size_t len) {
    char *copy = grown(NULL, len + 1);
    memcpy(copy, s, len);
    copy[len] = 0;
    return copy;
}

void free_request(request_t *r) {
    free(r->id);
    free(r);
}

void signal_fd(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR) {}
}

// -- connections ------------------------------------------------------------------------------------------------

void watch_events(Front *f, connection_t *c) {
    int reading = c->h2 ? c->out_len < unsent_limit(f) : c->in_len < (size_t)(f->max_head + f->max_body);
    int writing = c->out_len > 0;
    if (reading == c->reading && writing == c->writing) return;
    c->reading = reading;
    c->writing = writing;
    struct epoll_event event = {.events = (reading ? EPOLLIN | EPOLLRDHUP : 0) | (writing ? EPOLLOUT : 0),
                                .data.ptr = c};
    epoll_ctl(f->epoll_fd, EPOLL_CTL_MOD, c->fd, &event);
}

static void unlink_connection(Front *f, connection_t *c) {
    if (c->prev) c->prev->next = c->next;
    else f->connections = c->next;
    if (c->next) c->next->prev = c->prev;
    c->next_released = f->released;
    f->released = c;  // freed after this round of events: a later event of the same epoll_wait may name it
}

void close_connection(Front *f, connection_t *c) {
    if (c->closed) return;
    c->closed = 1;
    epoll_ctl(f->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    if (c->h2) h2_release(f, c);
    else if (c->current) abandon(f, c->current);
    unlink_connection(f, c);
}


// Close once what is buffered for it is written (at once if it is).
static void close_when_written(Front *f, connection_t *c) {
    c->closing = 1;
    if (flush(f, c) < 0 || !c->out_len) close_connection(f, c);
}

void append(connection_t *c, const char *bytes, size_t n) {
    if (c->out_len + n > c->out_cap) {
        c->out_cap = (c->out_len + n) * 2;
        c->out = grown(c->out, c->out_cap);
    }
    memcpy(c->out + c->out_len, bytes, n);
    c->out_len += n;
}

// Write what is buffered; what the socket does not take waits for EPOLLOUT. -1: the connection failed.
int flush(Front *f, connection_t *c) {
    size_t written = 0;
    while (written < c->out_len) {
        ssize_t k = send(c->fd, c->out + written, c->out_len - written, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            return -1;
        }
        written += k;
    }
    memmove(c->out, c->out + written, c->out_len - written);
    c->out_len -= written;
    watch_events(f, c);
    return 0;
}

static void respond(Front *f, connection_t *c, int status, const char *reason, const char *extra_headers,
                    const char *body, size_t body_len, int closing) {
    char head[256];
    int n = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                     "%s%s\r\n", status, reason, body_len, extra_headers, closing ? "Connection: close\r\n" : "");
    append(c, head, n);
    append(c, body, body_len);
    c->last_activity = now_ns();
}

static const char *reason_of(int status) {
    switch (status) {
        case 200: return "OK";
        case 400: return "Bad Request";
        case 429: return "Too Many Requests";
        case 500: return "Internal Server Error";
        case 503: return "Service Unavailable";
        case 504: return "Gateway Timeout";
        default: return "Error";
    }
}

// {"error":"<message>"}, the message escaped as JSON.
static void respond_error(Front *f, connection_t *c, int status, const char *message, size_t len, int closing) {
    char *body = grown(NULL, len * 6 + 16);
    size_t n = 0;
    memcpy(body, "{\"error\":\"", 10);
    n = 10;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = message[i];
        if (ch == '"' || ch == '\\') {
            body[n++] = '\\';
            body[n++] = ch;
        } else if (ch < 0x20) {
            n += sprintf(body + n, "\\u%04x", ch);
        } else {
            body[n++] = ch;
        }
    }
    memcpy(body + n, "\"}", 2);
    n += 2;
    const char *retry = status == 429 || status == 503 ? "Retry-After: " RETRY_AFTER "\r\n" : "";
    respond(f, c, status, reason_of(status), retry, body, n, closing);
    free(body);
}

// -- requests ---------------------------------------------------------------------------------------------------

// Take a request no worker has taken out of the queue. Under the lock.
static void unqueue(Front *f, request_t *r) {
    request_t **p = &f->queue_head, *previous = NULL;
    while (*p && *p != r) {
        previous = *p;
        p = &(*p)->next;
    }
    if (!*p) return;
    *p = r->next;
    if (f->queue_tail == r) f->queue_tail = previous;
    f->queued--;
    f->queued_rows -= r->rows;
}

// The request leaves its connection: freed now if queued (it is taken out of the queue), else when its batch comes
// back. Under no lock: takes it.
void abandon(Front *f, request_t *r) {
    if (r->stream) h2_detach(r->stream);
    else r->connection->current = NULL;
    r->connection = NULL;
    r->stream = NULL;
    pthread_mutex_lock(&f->lock);
    f->pending--;
    if (!r->taken) {
        unqueue(f, r);
        f->aborted++;
        f->aborted_ns += now_ns() - r->arrived;
        pthread_mutex_unlock(&f->lock);
        free_request(r);
        return;
    }
    pthread_mutex_unlock(&f->lock);
}

// -- requests: "mine, exactly" or "not mine" (_front_parse.c) ------------------------------------------------

// An Authorization header's value ("Bearer <token>") carries the token the front holds, and the Secret's file still
// holds it (its stamp unchanged); else the Python server reads the Secret and decides.
int token_matches(Front *f, const char *value, size_t len) {
    if (len < 7 || strncasecmp(value, "bearer ", 7) != 0) return 0;
    const char *token = value + 7;
    size_t token_len = len - 7;
    while (token_len && *token == ' ') token++, token_len--;
    pthread_mutex_lock(&f->lock);
    int same = f->token && token_len == f->token_len;
    unsigned char difference = 0;
    if (same) for (size_t i = 0; i < token_len; i++) difference |= token[i] ^ f->token[i];
    struct stat file;
    int current = same && f->token_path && stat(f->token_path, &file) == 0
                  && (long long)file.st_mtim.tv_sec * 1000000000 + file.st_mtim.tv_nsec == f->token_mtime_ns
                  && file.st_size == f->token_size;
    pthread_mutex_unlock(&f->lock);
    return same && !difference && current;
}

static int token_ok(void *f, const char *value, size_t len) {
    return token_matches(f, value, len);
}

// The request at the front of the connection's input: HTTP1_INCOMPLETE, HTTP1_MINE (*out: parsed, *used: its
// bytes) or HTTP1_NOT_MINE, which the Python server answers (at once, as it would have without the front).
static int recognize(Front *f, connection_t *c, request_t **out, size_t *used) {
    pthread_mutex_lock(&f->lock);
    long max_body = f->max_body, max_rows = f->max_rows, max_head = f->max_head;
    int needs_token = f->token != NULL;
    pthread_mutex_unlock(&f->lock);
    http1_spec_t spec = {f->infer_path, f->infer_path_len, max_head, max_body, needs_token, token_ok, f};
    const char *body;
    size_t body_len;
    int what = http1_recognise(c->in, c->in_len, &spec, &body, &body_len, used);
    if (what != HTTP1_MINE) return what;
    infer_spec_t input = {f->input_name, f->input_name_len, f->dims, f->shape, f->features, max_rows, max_body / 2};
    infer_body_t parsed;
    if (!infer_body_parse(body, body_len, &input, &parsed)) return HTTP1_NOT_MINE;
    long count = parsed.rows * f->features;
    request_t *r = grown(NULL, sizeof *r + count * sizeof(float));
    memset(r, 0, sizeof *r);
    r->rows = parsed.rows;
    if (!infer_body_values(&parsed, count, r->x)) {
        free(r);
        return HTTP1_NOT_MINE;
    }
    if (parsed.id) {
        r->id = grown(NULL, parsed.id_len);
        memcpy(r->id, parsed.id, parsed.id_len);
        r->id_len = parsed.id_len;
    }
    *out = r;
    return HTTP1_MINE;
}

// Give the connection to the Python server with what was read from it (it has no request in flight here).
static void hand_over(Front *f, connection_t *c) {
    struct handed *h = grown(NULL, sizeof *h);
    h->fd = c->fd;
    h->len = c->in_len;
    h->data = grown(NULL, c->in_len ? c->in_len : 1);
    memcpy(h->data, c->in, c->in_len);
    epoll_ctl(f->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    c->closed = 1;  // not closed: the fd is the Python server's now
    unlink_connection(f, c);
    pthread_mutex_lock(&f->lock);
    h->next = f->handed_head;
    f->handed_head = h;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->handed_fd);
}

// Queue a request (its connection and stream set): 0, or the status it is refused with (503 while the server drains,
// 429 when the queue is full) and why. Its deadline: the pool's requestTimeoutMs, or `limit_ns` when shorter (-1: none).
int enqueue(Front *f, request_t *r, int64_t limit_ns, char *why, size_t why_cap, int *why_len) {
    int64_t now = now_ns();
    r->arrived = now;
    pthread_mutex_lock(&f->lock);
    if (f->draining || f->stopping) {
        f->failed++;
        pthread_mutex_unlock(&f->lock);
        *why_len = snprintf(why, why_cap, "the server is shutting down");
        return 503;
    }
    if (f->queued + f->others >= f->queue_limit) {
        f->rejected++;
        *why_len = snprintf(why, why_cap, "%s", f->queue_full ? f->queue_full : "queue full");
        pthread_mutex_unlock(&f->lock);
        return 429;
    }
    r->deadline = now + (limit_ns >= 0 && limit_ns < f->timeout_ns ? limit_ns : f->timeout_ns);
    if (f->queue_tail) f->queue_tail->next = r;
    else f->queue_head = r;
    f->queue_tail = r;
    f->queued++;
    f->queued_rows += r->rows;
    f->pending++;
    int wake = f->want_rows && f->queued_rows >= f->want_rows;
    if (wake) f->want_rows = 0;
    pthread_mutex_unlock(&f->lock);
    if (wake) signal_fd(f->want_fd);
    return 0;
}

static void queue_request(Front *f, connection_t *c, request_t *r) {
    char why[200];
    int why_len;
    r->connection = c;
    c->current = r;
    c->requests++;
    int refused = enqueue(f, r, -1, why, sizeof why, &why_len);
    if (refused) {
        c->current = NULL;
        respond_error(f, c, refused, why, why_len, 0);
        free_request(r);
    }
}

// Take the requests at the front of the connection's input while none is in flight and its client reads answers.
static void take_requests(Front *f, connection_t *c) {
    while (!c->closed && !c->closing && !c->current && c->in_len && c->out_len < unsent_limit(f)) {
        request_t *r = NULL;
        size_t used = 0;
        int what = __atomic_load_n(&f->serving, __ATOMIC_ACQUIRE) ? recognize(f, c, &r, &used) : HTTP1_NOT_MINE;
        if (what == HTTP1_INCOMPLETE) break;
        if (what == HTTP1_NOT_MINE) {
            if (flush(f, c) < 0) close_connection(f, c);
            else if (!c->out_len) hand_over(f, c);  // else once its answers are written (EPOLLOUT)
            return;
        }
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        queue_request(f, c, r);
    }
    if (!c->closed && flush(f, c) < 0) close_connection(f, c);
}

static void readable(Front *f, connection_t *c) {
    if (c->in_cap - c->in_len < 16384) {
        c->in_cap = c->in_cap * 2 + 16384;
        c->in = grown(c->in, c->in_cap);
    }
    ssize_t k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    // The client sends no more. As the Python server does, a request in flight is withdrawn (a client that closes
    // has given up on it); bytes left unparsed go to the Python server, which answers them as it would have.
    if (k == 0 && c->in_len && !c->current && !c->out_len) {
        hand_over(f, c);
        return;
    }
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
        close_connection(f, c);
        return;
    }
    if (k > 0) {
        c->in_len += k;
        c->last_activity = now_ns();
    }
    take_requests(f, c);
    if (!c->closed) watch_events(f, c);
}

// -- answers ------------------------------------------------------------------------------------------------------

// Request r's answer, its outputs from example `offset` of batch b's, for the encoders (_front_answer.h).
answer_t answer_of(Front *f, request_t *r, batch_t *b, long offset) {
    return (answer_t){.model_name = f->model_name, .model_name_len = f->model_name_len, .version = f->version,
                      .version_len = f->version_len, .output_name = f->output_name,
                      .output_name_len = f->output_name_len, .id = r->id, .id_len = r->id_len, .rows = r->rows,
                      .dims = b->out_dims, .shape = b->out_shape, .y = b->y + offset * b->out_features};
}

// Answer request `index` of the batch, whose outputs begin at example `offset` of the batch's.
static void answer_request(Front *f, batch_t *b, int index, long offset, char **scratch, size_t *scratch_cap,
                           int closing) {
    request_t *r = b->requests[index];
    connection_t *c = r->connection;
    if (!c) return;  // answered already (504, 503) or its client left
    c->current = NULL;
    if (b->status != 200) {
        respond_error(f, c, b->status, b->message, b->message_len, closing);
        return;
    }
    answer_t answer = answer_of(f, r, b, offset);
    size_t need = json_answer_bound(&answer);
    if (need > *scratch_cap) {
        *scratch_cap = need * 2;
        *scratch = grown(*scratch, *scratch_cap);
    }
    char *body = *scratch;
    size_t n = json_answer(&answer, body);
    respond(f, c, 200, "OK", "", body, n, closing);
}

static void answer_batch(Front *f, batch_t *b, char **scratch, size_t *scratch_cap) {
    pthread_mutex_lock(&f->lock);
    int closing = f->draining || f->stopping;
    pthread_mutex_unlock(&f->lock);
    int answered = 0;
    for (int i = 0; i < b->n; i++) answered += b->requests[i]->connection != NULL;
    pthread_mutex_lock(&f->lock);  // counted before a client can read its answer
    f->pending -= answered;
    if (b->status == 200) f->success += answered;
    else f->failed += answered;
    pthread_mutex_unlock(&f->lock);
    long offset = 0;
    connection_t *dirty = NULL;  // gRPC connections answered: each flushed once, after the batch
    for (int i = 0; i < b->n; i++) {
        request_t *r = b->requests[i];
        connection_t *c = r->connection;
        long rows = r->rows;
        if (c && c->h2) {
            h2_answer(f, r, b, offset);
            if (!c->dirty) {
                c->dirty = 1;
                c->next_released = dirty;  // unused while the connection is open
                dirty = c;
            }
        } else if (c) {
            answer_request(f, b, i, offset, scratch, scratch_cap, closing);
            if (closing) {
                close_when_written(f, c);
            } else {
                take_requests(f, c);  // flushes
            }
        }
        free_request(r);
        offset += rows;
    }
    while (dirty) {
        connection_t *c = dirty;
        dirty = c->next_released;
        c->next_released = NULL;
        c->dirty = 0;
        h2_writable(f, c);
    }
    free(b->y);
    free(b->message);
    free(b);
}

// A request still waiting is answered now with `status` (a deadline passed, or the server stops); its batch, if a
// worker holds it, frees it later.
static void answer_early(Front *f, request_t *r, int status, const char *message, size_t len, int closing) {
    if (r->stream) {
        h2_answer_error(f, r, status, message, len);
        return;
    }
    connection_t *c = r->connection;
    r->connection = NULL;
    c->current = NULL;
    respond_error(f, c, status, message, len, closing);
    if (closing) {
        close_when_written(f, c);
    } else {
        take_requests(f, c);
    }
}

// A request past its deadline is answered 504 (DEADLINE_EXCEEDED over gRPC).
void expire(Front *f, request_t *r, int64_t now) {
    pthread_mutex_lock(&f->lock);
    int queued = !r->taken;
    if (queued) {  // out of the queue, freed here
        unqueue(f, r);
        f->expired++;
        f->expired_ns += now - r->arrived;
    }
    f->pending--;
    f->failed++;
    pthread_mutex_unlock(&f->lock);
    char why[160];  // its own timeout: a change of the pool's applies to requests received after it
    int why_len = r->stream && r->deadline - r->arrived < f->timeout_ns
        ? snprintf(why, sizeof why, "no output within the call's deadline of %.0f ms", (r->deadline - r->arrived) / 1e6)
        : snprintf(why, sizeof why, "no output within the pool's requestTimeoutMs of %.0f ms",
                   (r->deadline - r->arrived) / 1e6);
    answer_early(f, r, 504, why, why_len, 0);
    if (queued) free_request(r);
}

// Deadlines (504), and HTTP/1.1 connections idle for idle_timeout or holding a partial request for longer than its
// head's and body's timeouts together (slowloris): closed. gRPC connections: h2_sweep.
static void sweep(Front *f) {
    int64_t now = now_ns();
    pthread_mutex_lock(&f->lock);
    int64_t idle = f->idle_timeout_ns, partial = f->header_timeout_ns + f->body_timeout_ns;
    pthread_mutex_unlock(&f->lock);
    for (connection_t *c = f->connections, *next; c; c = next) {
        next = c->next;
        if (c->h2) {
            h2_sweep(f, c, now);
            continue;
        }
        request_t *r = c->current;
        if (r && now > r->deadline) {
            expire(f, r, now);
            continue;
        }
        if (r || !c->in_len || c->requests != c->swept_requests) {  // no partial request, or a new one since
            c->partial_since = !r && c->in_len ? now : 0;
            c->swept_requests = c->requests;
        } else if (!c->partial_since) {
            c->partial_since = now;
        }
        if ((!r && !c->in_len && !c->out_len && now - c->last_activity > idle)
            || (c->partial_since && now - c->partial_since > partial))
            close_connection(f, c);
    }
}

// The server stops: every request not answered is answered 503 with `message`, every connection closed once its
// answers are written (or at once).
static void stop_all(Front *f) {
    pthread_mutex_lock(&f->lock);
    char *message = f->stop_message ? f->stop_message : "the server stopped";
    size_t len = strlen(message);
    for (request_t *r = f->queue_head, *next; r; r = next) {
        next = r->next;
        r->taken = 1;  // out of the queue; freed below once answered
    }
    request_t *queued = f->queue_head;
    f->queue_head = f->queue_tail = NULL;
    f->queued = f->queued_rows = 0;
    pthread_mutex_unlock(&f->lock);
    for (connection_t *c = f->connections, *next; c; c = next) {
        next = c->next;
        if (c->h2) {
            h2_stop(f, c, message, len);
        } else if (c->current) {
            pthread_mutex_lock(&f->lock);
            f->pending--;
            f->failed++;
            pthread_mutex_unlock(&f->lock);
            answer_early(f, c->current, 503, message, len, 1);
        } else {
            flush(f, c);
            close_connection(f, c);
        }
    }
    for (request_t *r = queued, *next; r; r = next) {
        next = r->next;
        free_request(r);
    }
}

static void free_released(Front *f) {
    while (f->released) {
        connection_t *c = f->released;
        f->released = c->next_released;
        free(c->in);
        free(c->out);
        free(c);
    }
}

static void watch_adopted(Front *f) {
    pthread_mutex_lock(&f->lock);
    struct adopted *a = f->adopted_head;
    f->adopted_head = NULL;
    pthread_mutex_unlock(&f->lock);
    while (a) {
        struct adopted *next = a->next;
        int one = 1;
        setsockopt(a->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        connection_t *c = grown(NULL, sizeof *c);
        memset(c, 0, sizeof *c);
        c->fd = a->fd;
        c->reading = 1;
        c->last_activity = now_ns();
        struct epoll_event event = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(f->epoll_fd, EPOLL_CTL_ADD, c->fd, &event) < 0) {
            close(c->fd);
            free(c);
        } else {
            c->next = f->connections;
            if (f->connections) f->connections->prev = c;
            f->connections = c;
            if (a->grpc) h2_start(f, c);
        }
        free(a);
        a = next;
    }
}

static void serve(Front *f) {
    struct epoll_event events[256];
    char *scratch = NULL;
    size_t scratch_cap = 0;
    int64_t next_sweep = now_ns() + SWEEP_MS * 1000000LL;
    for (;;) {
        int n = epoll_wait(f->epoll_fd, events, 256, SWEEP_MS);
        if (n < 0 && errno != EINTR) break;
        for (int i = 0; i < n; i++) {
            void *what = events[i].data.ptr;
            if (what == &f->wake_fd) {
                uint64_t count;
                if (read(f->wake_fd, &count, sizeof count) < 0 && errno != EAGAIN) continue;
                watch_adopted(f);
                h2_write_call_answers(f);
                pthread_mutex_lock(&f->lock);
                batch_t *b = f->answered_head;
                f->answered_head = f->answered_tail = NULL;
                pthread_mutex_unlock(&f->lock);
                while (b) {
                    batch_t *next = b->next;
                    answer_batch(f, b, &scratch, &scratch_cap);
                    b = next;
                }
                continue;
            }
            connection_t *c = what;
            if (c->closed) continue;  // closed or handed over by an earlier event of this wait
            if (c->h2) {
                if (events[i].events & EPOLLOUT) h2_writable(f, c);
                if (!c->closed && events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) h2_readable(f, c);
                continue;
            }
            if (events[i].events & EPOLLOUT) {
                if (flush(f, c) < 0 || (c->closing && !c->out_len)) {
                    close_connection(f, c);
                    continue;
                }
                take_requests(f, c);
                if (c->closed) continue;
            }
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) readable(f, c);
        }
        int64_t now = now_ns();
        if (now >= next_sweep) {
            sweep(f);
            next_sweep = now + SWEEP_MS * 1000000LL;
        }
        free_released(f);
        pthread_mutex_lock(&f->lock);
        int stopping = f->stopping;
        pthread_mutex_unlock(&f->lock);
        if (stopping) break;
    }
    stop_all(f);
    free_released(f);
    free(scratch);
}

// -- the Python type ----------------------------------------------------------------------------------------------

// The limits (limits.py's Limits, by the names of its fields): each a positive number; the windows and streams at
// most 2^31-1 as HTTP/2 has them.
enum { LIMIT_LONG, LIMIT_SECONDS };
static const struct { const char *name; size_t offset; int kind; long most; } LIMITS[] = {
    {"max_message_bytes", offsetof(Front, max_message), LIMIT_LONG, LONG_MAX},
    {"max_body_bytes", offsetof(Front, max_body), LIMIT_LONG, LONG_MAX},
    {"max_head_bytes", offsetof(Front, max_head), LIMIT_LONG, 0x7fffffff},
    {"max_streams", offsetof(Front, max_streams), LIMIT_LONG, 0x7fffffff},
    {"stream_window_bytes", offsetof(Front, stream_window), LIMIT_LONG, 0x7fffffff},
    {"connection_window_bytes", offsetof(Front, connection_window), LIMIT_LONG, 0x7fffffff},
    {"connection_buffer_bytes", offsetof(Front, connection_buffer), LIMIT_LONG, LONG_MAX},
    {"process_buffer_bytes", offsetof(Front, process_buffer), LIMIT_LONG, LONG_MAX},
    {"unsent_bytes", offsetof(Front, unsent_bytes), LIMIT_LONG, LONG_MAX},
    {"header_timeout_s", offsetof(Front, header_timeout_ns), LIMIT_SECONDS, 0},
    {"body_timeout_s", offsetof(Front, body_timeout_ns), LIMIT_SECONDS, 0},
    {"idle_timeout_s", offsetof(Front, idle_timeout_ns), LIMIT_SECONDS, 0},
    {"reset_burst", offsetof(Front, reset_burst), LIMIT_LONG, LONG_MAX},
    {"resets_per_second", offsetof(Front, resets_per_second), LIMIT_LONG, LONG_MAX},
    {"max_continuations", offsetof(Front, max_continuations), LIMIT_LONG, LONG_MAX},
    {"max_owed_acks", offsetof(Front, max_owed_acks), LIMIT_LONG, LONG_MAX},
    {"max_settings", offsetof(Front, max_settings), LIMIT_LONG, LONG_MAX},
};
#define LIMIT_COUNT (sizeof LIMITS / sizeof *LIMITS)

// Take the limits `kwargs` names (every one of them if `all`), removing them from it; -1 with an exception.
static int take_limits(Front *f, PyObject *kwargs, int all) {
    long values[LIMIT_COUNT];
    int given[LIMIT_COUNT] = {0};
    for (size_t i = 0; i < LIMIT_COUNT; i++) {
        PyObject *value = kwargs ? PyDict_GetItemString(kwargs, LIMITS[i].name) : NULL;
        if (!value) {
            if (all) {
                PyErr_Format(PyExc_TypeError, "the limit %s is missing", LIMITS[i].name);
                return -1;
            }
            continue;
        }
        if (LIMITS[i].kind == LIMIT_SECONDS) {
            double seconds = PyFloat_AsDouble(value);
            if (seconds == -1 && PyErr_Occurred()) return -1;
            if (!(seconds > 0 && seconds < 9e9)) {
                PyErr_Format(PyExc_ValueError, "the limit %s must be a positive number of seconds", LIMITS[i].name);
                return -1;
            }
            values[i] = (long)(seconds * 1e9);
        } else {
            values[i] = PyLong_AsLong(value);
            if (values[i] == -1 && PyErr_Occurred()) return -1;
            if (values[i] < 1 || values[i] > LIMITS[i].most) {
                PyErr_Format(PyExc_ValueError, "the limit %s must be from 1 to %ld", LIMITS[i].name, LIMITS[i].most);
                return -1;
            }
        }
        given[i] = 1;
    }
    pthread_mutex_lock(&f->lock);
    for (size_t i = 0; i < LIMIT_COUNT; i++) {
        if (!given[i]) continue;
        if (LIMITS[i].kind == LIMIT_SECONDS)
            __atomic_store_n((int64_t *)((char *)f + LIMITS[i].offset), (int64_t)values[i], __ATOMIC_RELAXED);
        else
            __atomic_store_n((long *)((char *)f + LIMITS[i].offset), values[i], __ATOMIC_RELAXED);
        PyDict_DelItemString(kwargs, LIMITS[i].name);
    }
    pthread_mutex_unlock(&f->lock);
    return 0;
}

// Front(**limits): a front with no model: it carries the connections (gRPC calls all go to calls()) until
// serve_model().
static int Front_init(Front *f, PyObject *args, PyObject *kwargs) {
    if (f->wake_fd > 0) {
        PyErr_SetString(PyExc_RuntimeError, "a Front is initialized once");
        return -1;
    }
    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "Front takes the limits as keyword arguments");
        return -1;
    }
    PyObject *rest = kwargs ? PyDict_Copy(kwargs) : PyDict_New();
    if (!rest) return -1;
    pthread_mutex_init(&f->lock, NULL);
    if (take_limits(f, rest, 1) < 0) {
        Py_DECREF(rest);
        return -1;
    }
    if (PyDict_GET_SIZE(rest)) {
        PyObject *names = PyDict_Keys(rest);
        PyErr_Format(PyExc_TypeError, "Front takes no arguments %R", names);
        Py_XDECREF(names);
        Py_DECREF(rest);
        return -1;
    }
    Py_DECREF(rest);
    f->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    f->handed_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    f->want_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f->epoll_fd < 0 || f->wake_fd < 0 || f->handed_fd < 0 || f->want_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = &f->wake_fd};
    if (epoll_ctl(f->epoll_fd, EPOLL_CTL_ADD, f->wake_fd, &event) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void Front_dealloc(Front *f) {
    // Only once run() has returned (the Python wrapper joins its thread): nothing else touches the state.
    for (connection_t *c = f->connections, *next; c; c = next) {
        next = c->next;
        close(c->fd);
        if (c->h2) h2_release(f, c);
        free(c->in);
        free(c->out);
        free(c);
    }
    while (f->handed_head) {
        struct handed *h = f->handed_head;
        f->handed_head = h->next;
        close(h->fd);
        free(h->data);
        free(h);
    }
    while (f->calls_head) {
        struct call *call = f->calls_head;
        f->calls_head = call->next;
        free_call(call);
    }
    while (f->call_answers_head) {
        struct call_answer *answer = f->call_answers_head;
        f->call_answers_head = answer->next;
        free_call_answer(answer);
    }
    while (f->adopted_head) {
        struct adopted *a = f->adopted_head;
        f->adopted_head = a->next;
        close(a->fd);
        free(a);
    }
    int fds[] = {f->epoll_fd, f->wake_fd, f->handed_fd, f->want_fd};
    for (int i = 0; i < 4; i++)
        if (fds[i] > 0) close(fds[i]);
    free(f->infer_path);
    free(f->input_name);
    free(f->output_name);
    free(f->model_name);
    free(f->version);
    free(f->token);
    free(f->token_path);
    free(f->stop_message);
    free(f->queue_full);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static int ready(Front *f) {
    if (f->wake_fd <= 0) {
        PyErr_SetString(PyExc_RuntimeError, "the Front is not initialized");
        return 0;
    }
    return 1;
}

// serve_model(model=, version=, input_name=, example_shape=, output_name=, max_rows=, queue_limit=, timeout_ms=):
// from now on the front serves the model's common inference request (HTTP) and ModelInfer call (gRPC) itself.
static PyObject *Front_serve_model(Front *f, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"model", "version", "input_name", "example_shape", "output_name", "max_rows",
                            "queue_limit", "timeout_ms", NULL};
    const char *model, *version, *input_name, *output_name;
    Py_ssize_t model_len, version_len, input_len, output_len;
    PyObject *shape;
    long max_rows;
    int queue_limit;
    double timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$s#s#s#Os#lid", names, &model, &model_len, &version,
                                     &version_len, &input_name, &input_len, &shape, &output_name, &output_len,
                                     &max_rows, &queue_limit, &timeout_ms))
        return NULL;
    if (!ready(f)) return NULL;
    if (f->infer_path) {
        PyErr_SetString(PyExc_RuntimeError, "a Front serves one model");
        return NULL;
    }
    PyObject *dims = PySequence_Fast(shape, "example_shape must be a sequence of ints");
    if (!dims) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(dims);
    if (count > MAX_DIMS) {
        Py_DECREF(dims);
        PyErr_Format(PyExc_ValueError, "example_shape has %zd dimensions; at most %d", count, MAX_DIMS);
        return NULL;
    }
    f->features = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        long dim = PyLong_AsLong(PySequence_Fast_GET_ITEM(dims, i));
        if (dim < 1) {
            Py_DECREF(dims);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "example_shape's dimensions must be >= 1");
            return NULL;
        }
        f->shape[i] = dim;
        f->features *= dim;
    }
    f->dims = count;
    Py_DECREF(dims);
    for (const char *s = model; *s; s++)
        if (!(isalnum((unsigned char)*s) || *s == '-' || *s == '_' || *s == '.')) {
            PyErr_SetString(PyExc_ValueError, "the model name must be letters, digits, '-', '_' or '.'");
            return NULL;
        }
    char path[512];
    int n = snprintf(path, sizeof path, "/v2/models/%s/infer", model);
    if (n >= (int)sizeof path) {
        PyErr_SetString(PyExc_ValueError, "the model name is too long");
        return NULL;
    }
    f->infer_path = copied(path, n);
    f->infer_path_len = n;
    f->input_name = copied(input_name, input_len);
    f->input_name_len = input_len;
    f->output_name = copied(output_name, output_len);
    f->output_name_len = output_len;
    f->model_name = copied(model, model_len);
    f->model_name_len = model_len;
    f->version = copied(version, version_len);
    f->version_len = version_len;
    pthread_mutex_lock(&f->lock);
    f->max_rows = max_rows;
    f->queue_limit = queue_limit;
    f->timeout_ns = (int64_t)(timeout_ms * 1e6);
    pthread_mutex_unlock(&f->lock);
    __atomic_store_n(&f->serving, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}


static PyObject *Front_run(Front *f, PyObject *unused) {
    if (!ready(f)) return NULL;
    if (f->running) return PyErr_Format(PyExc_RuntimeError, "the Front runs already");
    f->running = 1;
    Py_BEGIN_ALLOW_THREADS
    serve(f);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *adopt(Front *f, PyObject *arg, int grpc) {
    if (!ready(f)) return NULL;
    int fd = PyLong_AsLong(arg);
    if (fd < 0) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "not a file descriptor");
    // An accepted socket does not inherit its listener's O_NONBLOCK: without it, a client that stops reading would
    // block the I/O thread's writes, and every other client with them.
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    struct adopted *a = grown(NULL, sizeof *a);
    a->fd = fd;
    a->grpc = grpc;
    pthread_mutex_lock(&f->lock);  // the connections are the I/O thread's: it watches this one when woken
    a->next = f->adopted_head;
    f->adopted_head = a;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *Front_adopt(Front *f, PyObject *arg) { return adopt(f, arg, 0); }

static PyObject *Front_adopt_grpc(Front *f, PyObject *arg) { return adopt(f, arg, 1); }

// calls() -> [(serial, stream, {header: value}, body)]: the gRPC calls for the Python server since the last call,
// oldest first (see answer_call). Header names and values as latin-1, a repeated name's last value. (serial,
// stream, None, None): that call is cancelled (its client reset it or left).
static PyObject *Front_calls(Front *f, PyObject *unused) {
    struct call *call;
    TAKE_IN_ORDER(f, calls_head, struct call, call);
    PyObject *list = PyList_New(0);
    while (call) {
        PyObject *headers = list ? PyDict_New() : NULL;
        for (const char *p = call->fields, *end = call->fields + call->fields_len; headers && p < end; ) {
            uint32_t name_len, value_len;  // (u32 length, bytes) each
            memcpy(&name_len, p, 4);
            memcpy(&value_len, p + 4 + name_len, 4);
            PyObject *name = PyUnicode_DecodeLatin1(p + 4, name_len, NULL);
            PyObject *value = PyUnicode_DecodeLatin1(p + 8 + name_len, value_len, NULL);
            if (!name || !value || PyDict_SetItem(headers, name, value) < 0) Py_CLEAR(headers);
            Py_XDECREF(name);
            Py_XDECREF(value);
            p += 8 + name_len + value_len;
        }
        PyObject *item;
        if (call->cancelled) {
            Py_XDECREF(headers);
            item = list ? Py_BuildValue("KIOO", (unsigned long long)call->serial, (unsigned int)call->stream, Py_None,
                                        Py_None) : NULL;
        } else {
            item = headers ? Py_BuildValue("KINy#", (unsigned long long)call->serial, (unsigned int)call->stream,
                                           headers, call->body ? call->body : "", (Py_ssize_t)call->body_len) : NULL;
        }
        if (!item || PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_XDECREF(item);
        struct call *next = call->next;
        free_call(call);
        call = next;
    }
    return list;
}

static int optional_bytes(PyObject *object, char **copy, size_t *len) {
    *copy = NULL;
    *len = 0;
    if (object == Py_None) return 0;
    char *bytes;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(object, &bytes, &n) < 0) return -1;
    *copy = grown(NULL, n ? n : 1);
    memcpy(*copy, bytes, n);
    *len = n;
    return 0;
}

// answer_call(serial, stream, code, message, data): the Python server's answer to a call: its gRPC status code and
// message (percent-encoded here), and for code 0 its length-prefixed message (data; None: a trailers-only answer);
// dropped if the call is gone.
static PyObject *Front_answer_call(Front *f, PyObject *args) {
    unsigned long long serial;
    unsigned int stream;
    int code;
    const char *message;
    Py_ssize_t message_len;
    PyObject *data;
    if (!PyArg_ParseTuple(args, "KIis#O", &serial, &stream, &code, &message, &message_len, &data)) return NULL;
    struct call_answer *answer = grown(NULL, sizeof *answer);
    memset(answer, 0, sizeof *answer);
    answer->serial = serial;
    answer->stream = stream;
    answer->code = code;
    answer->message = copied(message, message_len);
    answer->message_len = message_len;
    if (optional_bytes(data, &answer->data, &answer->data_len) < 0) {
        free_call_answer(answer);
        return NULL;
    }
    pthread_mutex_lock(&f->lock);
    answer->next = f->call_answers_head;
    f->call_answers_head = answer;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *Front_take(Front *f, PyObject *args) {
    int max_rows, max_requests, oversized;
    if (!PyArg_ParseTuple(args, "iip", &max_rows, &max_requests, &oversized)) return NULL;
    if (!ready(f)) return NULL;
    pthread_mutex_lock(&f->lock);
    int n = 0, rows = 0;
    for (request_t *r = f->queue_head; r && n < max_requests && rows + r->rows <= max_rows; r = r->next) {
        n++;
        rows += r->rows;
    }
    if (n == 0 && f->queue_head && max_requests > 0 && oversized) {  // a request over the limit runs alone
        n = 1;
        rows = f->queue_head->rows;
    }
    if (n == 0) {
        pthread_mutex_unlock(&f->lock);
        Py_RETURN_NONE;
    }
    batch_t *b = grown(NULL, sizeof *b + n * sizeof(request_t *));
    memset(b, 0, sizeof *b);
    b->n = n;
    b->rows = rows;
    for (int i = 0; i < n; i++) {
        request_t *r = f->queue_head;
        f->queue_head = r->next;
        r->taken = 1;
        b->requests[i] = r;
    }
    if (!f->queue_head) f->queue_tail = NULL;
    f->queued -= n;
    f->queued_rows -= rows;
    pthread_mutex_unlock(&f->lock);
    // The requests are the batch's now: the I/O thread reads only their connection and deadline.
    PyObject *x = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)rows * f->features * sizeof(float));
    PyObject *arrivals = PyList_New(n);
    if (!x || !arrivals) {
        Py_XDECREF(x);
        Py_XDECREF(arrivals);
        return NULL;  // the batch is lost: its requests answer 504 at their deadline
    }
    float *into = (float *)PyByteArray_AS_STRING(x);
    for (int i = 0; i < n; i++) {
        request_t *r = b->requests[i];
        memcpy(into, r->x, (size_t)r->rows * f->features * sizeof(float));
        into += (size_t)r->rows * f->features;
        PyList_SET_ITEM(arrivals, i, PyLong_FromLongLong(r->arrived));
    }
    return Py_BuildValue("NiKN", x, rows, (unsigned long long)(uintptr_t)b, arrivals);
}

static void hand_back(Front *f, batch_t *b) {
    b->next = NULL;
    pthread_mutex_lock(&f->lock);
    if (f->answered_tail) f->answered_tail->next = b;
    else f->answered_head = b;
    f->answered_tail = b;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->wake_fd);
}

// give(handle, outputs, example_shape): the batch's outputs (rows x example_shape float32, C order).
static PyObject *Front_give(Front *f, PyObject *args) {
    unsigned long long handle;
    Py_buffer y;
    PyObject *shape;
    if (!PyArg_ParseTuple(args, "Ky*O", &handle, &y, &shape)) return NULL;
    batch_t *b = (batch_t *)(uintptr_t)handle;
    PyObject *dims = PySequence_Fast(shape, "example_shape must be a sequence of ints");
    if (!dims) {
        PyBuffer_Release(&y);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(dims);
    long features = 1;
    for (Py_ssize_t i = 0; i < count && i < MAX_DIMS; i++) {
        b->out_shape[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(dims, i));
        features *= b->out_shape[i];
    }
    Py_DECREF(dims);
    if (count > MAX_DIMS || PyErr_Occurred() || (size_t)y.len != (size_t)b->rows * features * sizeof(float)) {
        PyBuffer_Release(&y);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "outputs of %zd bytes for %d examples of %ld float32", y.len, b->rows,
                         features);
        return NULL;
    }
    b->out_dims = count;
    b->out_features = features;
    b->y = grown(NULL, y.len ? y.len : 1);
    memcpy(b->y, y.buf, y.len);
    PyBuffer_Release(&y);
    b->status = 200;
    hand_back(f, b);
    Py_RETURN_NONE;
}

// fail(handle, status, message): answer the batch's requests with an error.
static PyObject *Front_fail(Front *f, PyObject *args) {
    unsigned long long handle;
    int status;
    const char *message;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Kis#", &handle, &status, &message, &len)) return NULL;
    batch_t *b = (batch_t *)(uintptr_t)handle;
    b->status = status;
    b->message = copied(message, len);
    b->message_len = len;
    hand_back(f, b);
    Py_RETURN_NONE;
}

// split(handle) -> [(handle, rows)]: a taken batch as one batch per request, in order (the one-at-a-time retry of a
// failed forward); the handle given is spent.
static PyObject *Front_split(Front *f, PyObject *arg) {
    unsigned long long handle = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    batch_t *b = (batch_t *)(uintptr_t)handle;
    PyObject *parts = PyList_New(b->n);
    if (!parts) return NULL;
    for (int i = 0; i < b->n; i++) {
        batch_t *one = grown(NULL, sizeof *one + sizeof(request_t *));
        memset(one, 0, sizeof *one);
        one->n = 1;
        one->rows = b->requests[i]->rows;
        one->requests[0] = b->requests[i];
        PyList_SET_ITEM(parts, i, Py_BuildValue("Ki", (unsigned long long)(uintptr_t)one, one->rows));
    }
    free(b);
    return parts;
}

// queued() -> (rows, requests, oldest arrival ns or 0)
static PyObject *Front_queued(Front *f, PyObject *unused) {
    pthread_mutex_lock(&f->lock);
    int rows = f->queued_rows, n = f->queued;
    long long oldest = f->queue_head ? f->queue_head->arrived : 0;
    pthread_mutex_unlock(&f->lock);
    return Py_BuildValue("iiL", rows, n, oldest);
}

// others(n): ParallelInference's own queue holds n requests (queueLimit counts them with the front's).
static PyObject *Front_others(Front *f, PyObject *arg) {
    int n = PyLong_AsLong(arg);
    if (n < 0 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&f->lock);
    f->others = n;
    pthread_mutex_unlock(&f->lock);
    Py_RETURN_NONE;
}

// want(rows): signal want_fd once `rows` are queued (now, if they are); 0: no one waits.
static PyObject *Front_want(Front *f, PyObject *arg) {
    int rows = PyLong_AsLong(arg);
    if (rows < 0 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&f->lock);
    int now = rows > 0 && f->queued_rows >= rows;
    f->want_rows = now ? 0 : rows;
    pthread_mutex_unlock(&f->lock);
    if (now) signal_fd(f->want_fd);
    Py_RETURN_NONE;
}

// wait_wanted(): block (without the GIL) until want_fd is signalled; False once the front stops.
static PyObject *Front_wait_wanted(Front *f, PyObject *unused) {
    uint64_t count;
    int stopping = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (read(f->want_fd, &count, sizeof count) == sizeof count) break;
        pthread_mutex_lock(&f->lock);
        stopping = f->stopping;
        pthread_mutex_unlock(&f->lock);
        if (stopping) break;
        struct pollfd readable = {.fd = f->want_fd, .events = POLLIN};
        poll(&readable, 1, 100);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(!stopping);
}

// handed() -> [(fd, bytes read from it)], the connections handed over since the last call, oldest first.
static PyObject *Front_handed(Front *f, PyObject *unused) {
    uint64_t count;
    if (read(f->handed_fd, &count, sizeof count) < 0 && errno != EAGAIN) return PyErr_SetFromErrno(PyExc_OSError);
    struct handed *h;
    TAKE_IN_ORDER(f, handed_head, struct handed, h);
    PyObject *list = PyList_New(0);
    while (h) {
        PyObject *item = list ? Py_BuildValue("iy#", h->fd, h->data, (Py_ssize_t)h->len) : NULL;
        if (!item || PyList_Append(list, item) < 0) {
            close(h->fd);
            Py_CLEAR(list);
        }
        Py_XDECREF(item);
        struct handed *next = h->next;
        free(h->data);
        free(h);
        h = next;
    }
    return list;
}

static PyObject *Front_configure(Front *f, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"queue_limit", "timeout_ms", "max_rows", "token", "token_path", "token_stamp",
                            "queue_full", "grpc_codes", NULL};
    int queue_limit = -1;
    const char *queue_full = NULL;
    Py_buffer codes = {0};
    double timeout_ms = -1;
    long max_rows = -1;
    PyObject *token = NULL;
    const char *token_path = NULL;
    long long mtime_ns = 0, size = 0;
    PyObject *rest = kwargs ? PyDict_Copy(kwargs) : PyDict_New();
    if (!rest) return NULL;
    int parsed = take_limits(f, rest, 0) == 0
        && PyArg_ParseTupleAndKeywords(args, rest, "|idlSs(LL)sy*", names, &queue_limit, &timeout_ms, &max_rows,
                                       &token, &token_path, &mtime_ns, &size, &queue_full, &codes);
    Py_DECREF(rest);
    if (!parsed) return NULL;
    if (codes.buf && codes.len != (Py_ssize_t)sizeof f->grpc_codes) {
        PyBuffer_Release(&codes);
        PyErr_Format(PyExc_ValueError, "grpc_codes holds the code of each HTTP status 400-599: %zu bytes",
                     sizeof f->grpc_codes);
        return NULL;
    }
    if (token && !token_path) {
        PyErr_SetString(PyExc_TypeError, "a token needs its token_path and token_stamp");
        return NULL;
    }
    char *token_copy = NULL, *path_copy = NULL;
    if (token) {
        char *bytes;
        Py_ssize_t token_len;
        if (PyBytes_AsStringAndSize(token, &bytes, &token_len) < 0) return NULL;
        token_copy = copied(bytes, token_len);
        path_copy = copied(token_path, strlen(token_path));
    }
    pthread_mutex_lock(&f->lock);
    if (queue_limit > 0) f->queue_limit = queue_limit;
    if (timeout_ms > 0) f->timeout_ns = (int64_t)(timeout_ms * 1e6);
    if (max_rows >= 0) f->max_rows = max_rows;
    if (queue_full) {
        free(f->queue_full);
        f->queue_full = copied(queue_full, strlen(queue_full));
    }
    if (codes.buf) memcpy(f->grpc_codes, codes.buf, sizeof f->grpc_codes);
    if (token) {
        free(f->token);
        free(f->token_path);
        f->token = token_copy;
        f->token_len = PyBytes_GET_SIZE(token);
        f->token_path = path_copy;
        f->token_mtime_ns = mtime_ns;
        f->token_size = size;
    }
    pthread_mutex_unlock(&f->lock);
    PyBuffer_Release(&codes);
    Py_RETURN_NONE;
}

static PyObject *Front_counters(Front *f, PyObject *unused) {
    pthread_mutex_lock(&f->lock);
    PyObject *result = Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsi}", "success", f->success, "failed", f->failed, "rejected", f->rejected,
        "pending", f->pending, "expired", f->expired, "expired_ns", f->expired_ns, "aborted", f->aborted,
        "aborted_ns", f->aborted_ns, "queued", f->queued);
    pthread_mutex_unlock(&f->lock);
    return result;
}

// drain(): new requests are answered 503 from now on; those queued and running are answered as usual.
static PyObject *Front_drain(Front *f, PyObject *unused) {
    pthread_mutex_lock(&f->lock);
    f->draining = 1;
    pthread_mutex_unlock(&f->lock);
    Py_RETURN_NONE;
}

// stop(message): run() answers what is not answered with 503 `message`, closes every connection and returns.
static PyObject *Front_stop(Front *f, PyObject *args) {
    const char *message;
    if (!PyArg_ParseTuple(args, "s", &message)) return NULL;
    pthread_mutex_lock(&f->lock);
    free(f->stop_message);
    f->stop_message = copied(message, strlen(message));
    f->stopping = 1;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->wake_fd);
    signal_fd(f->want_fd);
    Py_RETURN_NONE;
}

static PyObject *Front_handed_fd(Front *f, void *unused) { return PyLong_FromLong(f->handed_fd); }

static PyMethodDef Front_methods[] = {
    {"run", (PyCFunction)Front_run, METH_NOARGS, "run(): serve on this thread until stop()"},
    {"adopt", (PyCFunction)Front_adopt, METH_O, "adopt(fd): serve a connection accepted elsewhere (its fd is ours)"},
    {"adopt_grpc", (PyCFunction)Front_adopt_grpc, METH_O, "adopt_grpc(fd): serve a gRPC connection (HTTP/2, h2c)"},
    {"calls", (PyCFunction)Front_calls, METH_NOARGS, "calls() -> [(serial, stream, headers, body)]: gRPC calls for "
     "Python (handed_fd is readable when there are)"},
    {"answer_call", (PyCFunction)Front_answer_call, METH_VARARGS,
     "answer_call(serial, stream, code, message, data): answer a call calls() gave (data: the length-prefixed "
     "message of an OK, or None)"},
    {"serve_model", (PyCFunction)(void (*)(void))Front_serve_model, METH_VARARGS | METH_KEYWORDS,
     "serve_model(model=, version=, input_name=, example_shape=, output_name=, max_rows=, queue_limit=, "
     "timeout_ms=): serve the model's inference requests here from now on"},
    {"take", (PyCFunction)Front_take, METH_VARARGS,
     "take(max_rows, max_requests, oversized) -> (float32 examples, rows, handle, arrivals) or None"},
    {"give", (PyCFunction)Front_give, METH_VARARGS, "give(handle, outputs, example_shape): answer a taken batch"},
    {"fail", (PyCFunction)Front_fail, METH_VARARGS, "fail(handle, status, message): answer a taken batch's error"},
    {"split", (PyCFunction)Front_split, METH_O, "split(handle) -> [(handle, rows)]: one batch per request"},
    {"queued", (PyCFunction)Front_queued, METH_NOARGS, "queued() -> (rows, requests, oldest arrival ns)"},
    {"others", (PyCFunction)Front_others, METH_O, "others(n): requests in ParallelInference's own queue"},
    {"want", (PyCFunction)Front_want, METH_O, "want(rows): signal wait_wanted() once rows are queued (0: none)"},
    {"wait_wanted", (PyCFunction)Front_wait_wanted, METH_NOARGS, "block until want() is met; False once stopped"},
    {"handed", (PyCFunction)Front_handed, METH_NOARGS, "handed() -> [(fd, bytes read)]: connections for Python"},
    {"configure", (PyCFunction)(void (*)(void))Front_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(queue_limit=, timeout_ms=, max_rows=, token=, token_path=, token_stamp=, **limits)"},
    {"counters", (PyCFunction)Front_counters, METH_NOARGS, "counters() -> dict of the requests served here"},
    {"drain", (PyCFunction)Front_drain, METH_NOARGS, "drain(): answer new requests 503"},
    {"stop", (PyCFunction)Front_stop, METH_VARARGS, "stop(message): answer the rest 503, close, end run()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Front_getset[] = {
    {"handed_fd", (getter)Front_handed_fd, NULL, "readable when handed() has connections", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tandem.worker.serve._front.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The HTTP port's common inference request, served in C (see the module's source)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Front_init,
    .tp_dealloc = (destructor)Front_dealloc,
    .tp_methods = Front_methods,
    .tp_getset = Front_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_front", .m_size = -1};

PyMODINIT_FUNC PyInit__front(void) {
    if (PyType_Ready(&FrontType) < 0 || h2_init() < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&FrontType);
    if (PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
