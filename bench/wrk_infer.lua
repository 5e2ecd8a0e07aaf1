-- wrk script: POST one Open Inference Protocol request, read from the JSON file named after `--`, on every call.
--   wrk -t1 -c64 -d5s --latency -s bench/wrk_infer.lua http://127.0.0.1:8000/v2/models/mlp/infer -- body.json
-- Every request is the same pre-formatted bytes (no Lua work per request), as bench/loadgen.py sends them.
local request_bytes

function init(args)
  local file = assert(io.open(args[1], "rb"), "usage: ... -- BODY.json")
  local body = file:read("*a")
  file:close()
  request_bytes = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, body)
end

function request()
  return request_bytes
end
