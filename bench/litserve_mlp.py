"""The LitServe side of bench/bench_inference.py: the same digits MLP behind LitServe with its batching on.

    python bench/litserve_mlp.py HIDDEN MAX_BATCH WORKERS_PER_DEVICE BATCH_TIMEOUT THREADS PORT FAST_QUEUE(0|1)
"""

import sys

import litserve as ls
import torch

from tandem.examples.digits import mlp

HIDDEN, MAX_BATCH, WORKERS, PORT = (int(sys.argv[i]) for i in (1, 2, 3, 6))
BATCH_TIMEOUT, THREADS, FAST_QUEUE = float(sys.argv[4]), int(sys.argv[5]), sys.argv[7] == "1"


class MLP(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(THREADS)
        self.model = mlp(HIDDEN).eval()

    def decode_request(self, request):
        return torch.tensor(request["input"], dtype=torch.float32)

    def batch(self, inputs):
        return torch.stack(inputs)

    def predict(self, x):
        with torch.no_grad():
            return self.model(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"output": output.tolist()}


if __name__ == "__main__":
    server = ls.LitServer(MLP(max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT), accelerator="cpu", devices=1,
                          workers_per_device=WORKERS, fast_queue=FAST_QUEUE)
    server.run(host="127.0.0.1", port=PORT, num_api_servers=1, generate_client_file=False, log_level="warning")
