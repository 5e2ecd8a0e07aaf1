-- wrk script for bench/bench_capacity.py: bench/wrk_infer.lua's request (the JSON file named after `--`), and at the
-- end one line the benchmark reads, so that it can merge the latencies of several wrk runs (one per endpoint and
-- period) into one distribution:
--   TANDEM-WRK <requests> <connect> <read> <write> <status> <timeout> <q(0.1)> <q(0.2)> ... <q(100)>
-- the error counts as wrk's summary has them (status: responses >= 400) and the latency (microseconds) at each
-- 0.1 percentile. wrk's Lua API gives percentiles but not its histogram's counts, so a merged percentile is read
-- off these 1000 quantiles, each standing for a thousandth of its run's requests.
--   wrk -t1 -c16 -d2s -s bench/wrk_capacity.lua http://127.0.0.1:8000/v2/models/digits/infer -- body.json
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "wrk_infer.lua")

function done(summary, latency, requests)
  local errors = summary.errors
  local out = {"TANDEM-WRK", summary.requests, errors.connect, errors.read, errors.write, errors.status, errors.timeout}
  for i = 1, 1000 do
    out[#out + 1] = string.format("%d", latency:percentile(i / 10))
  end
  io.write(table.concat(out, " "), "\n")
end
