// What the C front parses and writes over HTTP/1.1 that is its own, as pure functions (no socket, no lock, no Python
// object), so a fuzzer calls them as the front does: the recogniser of the one HTTP/1.1 request the front serves (on
// llhttp, which parses the protocol), and its JSON both ways: the parser of that request's body and the encoder of its
// answer's (the front's own).
#ifndef TANDEM_FRONT_PARSE_H
#define TANDEM_FRONT_PARSE_H
#include <stddef.h>

#include "_front_answer.h"

// What a request at the start of a connection's input is to the front.
enum { HTTP1_INCOMPLETE, HTTP1_MINE, HTTP1_NOT_MINE };

// The one request the front takes: `POST <path> HTTP/1.1` with one Host, a Content-Length body of at most max_body
// bytes, no Transfer-Encoding, Content-Encoding, Expect, Upgrade or Inference-Header-Content-Length, Connection
// keep-alive if any, a head of at most max_head bytes, and at most one Authorization header, which token_ok(context,
// value) accepts (required when needs_token).
typedef struct {
    const char *path;
    size_t path_len;
    size_t max_head;
    long max_body;
    int needs_token;
    int (*token_ok)(void *context, const char *value, size_t len);
    void *context;
} http1_spec_t;

// The request at the start of in[0, len): HTTP1_INCOMPLETE (it may still become one of ours), HTTP1_NOT_MINE
// (anything else, malformed included: the Python server answers it), or HTTP1_MINE with its body in
// [*body, *body + *body_len) inside `in` and *used the bytes of head and body.
int http1_recognise(const char *in, size_t len, const http1_spec_t *spec, const char **body, size_t *body_len,
                    size_t *used);

// The model's one input, as the body must give it.
typedef struct {
    const char *input_name;
    size_t input_name_len;
    int dims;
    const long *shape;         // per example, `dims` of them
    long features;             // their product
    long max_rows;             // examples one request may carry
    long max_values;           // numbers one request may carry
} infer_spec_t;

// A body infer_body_parse took: its rows, its "id" (the JSON string with its quotes as sent; NULL: none) and its
// "data" list (from its '[' to the body's end, read by infer_body_values).
typedef struct {
    long rows;
    const char *id;
    size_t id_len;
    const char *data, *end;
} infer_body_t;

// The body {"inputs": [{"name": <the input's>, "shape": [rows, <the example's shape>], "datatype": "FP32",
// "data": [numbers]}]} with an optional "id" string, keys in any order, each once, nothing else: 1 (*out set), or 0
// (not ours: the Python server judges it).
int infer_body_parse(const char *body, size_t len, const infer_spec_t *spec, infer_body_t *out);

// The `count` (rows x features) numbers of a body infer_body_parse took, into x[0, count), read as the Python server
// reads them (a double rounded to float32): 1, or 0 (not ours: another count, or a number float32 cannot hold).
int infer_body_values(const infer_body_t *parsed, long count, float *x);

// The JSON answer's bound and body. Of the answer (_front_answer.h): the model's names are written as they are (the
// front serves only names that need no JSON escape: native.PLAIN_NAME), the id is the request's JSON string with its
// quotes as infer_body_parse took it (NULL: none), the shape's values are each >= 0 and rows x their product floats a
// count that does not overflow.

// At most the bytes json_answer writes, its text and a terminating NUL.
size_t json_answer_bound(const answer_t *answer);

// The answer's JSON body, {"model_name": ..., "model_version": ..., "id": <if any>, "outputs": [{"name": ...,
// "datatype": "FP32", "shape": [rows, <shape>], "data": [numbers]}]} without spaces, each number the shortest of %.8g
// and %.9g that reads back as the same float32 (null for NaN and the infinities, as orjson writes them): written to
// `into`, which holds json_answer_bound(answer) bytes, followed by a NUL; returns its length (without the NUL).
size_t json_answer(const answer_t *answer, char *into);

#endif
