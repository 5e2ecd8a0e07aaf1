// libFuzzer harness: the C front's gRPC message prefix (grpc_message) and its ModelInferRequest decoder
// (infer_request, hand-written protobuf) over arbitrary bodies. Besides the sanitizers' findings it checks that a
// call taken has rows within the model's limit and exactly rows x features FP32 values inside the message.
#include <assert.h>
#include <stdint.h>
#include <string.h>

#include "_front_infer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    infer_model_t model = {"digits", "1", "input", "output", 6, 1, 5, 6, 1, {64}, 64, 32};
    if (size > 0 && data[0] & 1) {  // another shape: two dimensions per example
        model.dims = 2;
        model.shape[0] = 2;
        model.shape[1] = 3;
        model.features = 6;
    }
    const unsigned char *message = NULL;
    size_t message_len = 0;
    if (!grpc_message(data, size, &message, &message_len)) {
        message = data;  // the decoder alone, too
        message_len = size;
    } else {
        assert(message >= data && message + message_len <= data + size);
    }
    infer_call_t call;
    if (!infer_request(&model, message, message_len, &call)) return 0;
    assert(call.rows >= 1 && call.rows <= model.max_rows);
    assert(call.raw_len == (size_t)call.rows * model.features * 4);
    assert(call.raw >= message && call.raw + call.raw_len <= message + message_len);
    assert(call.id_len == 0 || (call.id >= message && call.id + call.id_len <= message + message_len));
    return 0;
}
