// The gRPC part of the C front that is Tandem's own and not a protocol library's: the 5-byte gRPC message prefix,
// the one ModelInferRequest it decodes and the ModelInferResponse it encodes (hand-written protobuf). Pure functions
// of their arguments: no allocation, no Python, no socket, so that a fuzzer can call them alone (_front_infer.c).
#ifndef TANDEM_FRONT_INFER_H
#define TANDEM_FRONT_INFER_H
#include <stddef.h>
#include <stdint.h>

#include "_front_answer.h"

#define INFER_MAX_DIMS 8

// The served model as a ModelInferRequest must name it: names, its input's per-example shape, rows at most.
typedef struct {
    const char *model_name, *version, *input_name, *output_name;
    size_t model_name_len, version_len, input_name_len, output_name_len;
    int dims;
    long shape[INFER_MAX_DIMS];  // per example
    long features;               // the product of shape
    long max_rows;
} infer_model_t;

// A ModelInferRequest of the one shape the front serves: its rows, its raw FP32 contents (rows x features, as
// received: not aligned) and its id (empty: none), all pointing into the message decoded.
typedef struct {
    long rows;
    const unsigned char *raw, *id;
    size_t raw_len, id_len;
} infer_call_t;

// A gRPC request body that is exactly one uncompressed length-prefixed message: 1 and the message; else 0.
int grpc_message(const unsigned char *body, size_t len, const unsigned char **message, size_t *message_len);

// A ModelInferRequest of the one shape the front serves (the model, and its version if named; an optional printable
// id; the one input, FP32, of the model's example shape, at most max_rows rows, with its raw contents; outputs naming
// the model's, without parameters; nothing else): 1 and *call; else 0 (the Python server's to answer).
int infer_request(const infer_model_t *model, const unsigned char *message, size_t len, infer_call_t *call);


// The size of the answer's length-prefixed ModelInferResponse; 0 if it is over what gRPC's prefix can say (4 GiB).
size_t infer_response_size(const answer_t *answer);

// The answer's length-prefixed ModelInferResponse (model_name, model_version if any, id if any, the one output:
// name, FP32 and shape [rows, shape...], then raw_output_contents; in field order, as protobuf writes them), written
// to `into`, which holds infer_response_size(answer) bytes; that many bytes are written.
void infer_response(const answer_t *answer, unsigned char *into);

#endif
