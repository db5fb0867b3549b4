-- gptlua.progress — the numbers a training run prints: the device peak its
-- MFU divides by, and the formatting of sizes and times.
--
-- The peak is fixed per device, so MFU compares across runs (issue 15; it
-- used to be measured afresh at every start and moved 2x between runs):
--   * peak_flops set by the user: that value;
--   * a GPU: the table below (dense bf16 tensor-core peak of the vendor's
--     datasheet, as nanoGPT and nanochat report MFU), by device name;
--   * the CPU: an sgemm rate (per CPU second, see measure_cpu_flops)
--     calibrated once per machine (CPU model and thread count), cached in
--     $XDG_CACHE_HOME/gptlua/peak_flops.json (~/.cache/gptlua/...); delete
--     the file to calibrate again.
-- Every run prints the peak and where it came from.
local gl = require 'gptlua'
local ffi = require 'ffi'
local cjson = require 'cjson'
local now = require('gptlua.cli').now

local M = {}

-- name fragment (matched in order, plain) -> dense bf16 FLOP/s
M.GPU_PEAKS = {
  { 'H100 PCIe', 756e12 }, { 'H100', 989e12 }, { 'H200', 989e12 }, { 'GH200', 989e12 },
  { 'A100', 312e12 }, { 'A10G', 125e12 }, { 'A10', 125e12 }, { 'L40S', 362e12 }, { 'L4', 121e12 },
  { 'RTX 4090', 165e12 }, { 'RTX 3090', 71e12 }, { 'V100', 125e12 },
}

-- peak of a GPU by name, or nil
function M.gpu_peak(name)
  for _, e in ipairs(M.GPU_PEAKS) do
    if name:find(e[1], 1, true) then return e[2], e[1] end
  end
  return nil
end

-- the process's CPU seconds (all its threads)
local process_seconds = require('gptlua.libc').cpu_seconds

-- CPU peak: what BLAS sustains in a float32 sgemm with the current thread
-- count, the best of a few short timings.  Timed in CPU seconds per thread,
-- not wall seconds: on a busy machine the wall rate fell 4x between runs
-- (17-43 GFLOP/s with 16 processes on 2 cores) while this one held at
-- 164-172, so a calibration made while other work runs is still this
-- machine's peak.
function M.measure_cpu_flops()
  local n = 512
  local a, b = gl.randn({ n, n }, { seed = 1 }), gl.randn({ n, n }, { seed = 2 })
  local c = gl.empty({ n, n })
  gl.matmul_raw(a, b, c)
  local threads, best = gl.get_num_threads(), 0
  for _ = 1, 5 do
    local reps, t0 = 0, process_seconds()
    repeat gl.matmul_raw(a, b, c); reps = reps + 1 until process_seconds() - t0 > 0.08 * threads
    best = math.max(best, 2 * n * n * n * reps / ((process_seconds() - t0) / threads))
  end
  return best
end

function M.cache_path(getenv)
  getenv = getenv or os.getenv
  local base = getenv('XDG_CACHE_HOME')
  if not base or base == '' then base = (getenv('HOME') or '.') .. '/.cache' end
  return base .. '/gptlua/peak_flops.json'
end

local function cpu_key()
  local model = 'cpu'
  local f = io.open('/proc/cpuinfo', 'rb')
  if f then
    for line in f:lines() do
      local m = line:match('^model name%s*:%s*(.-)%s*$')
      if m then model = m; break end
    end
    f:close()
  end
  return ('%s, %d threads'):format(model, gl.get_num_threads())
end

local function read_cache(path)
  local f = io.open(path, 'rb')
  if not f then return {} end
  local s = f:read('*a')
  f:close()
  local ok, t = pcall(cjson.decode, s)
  return (ok and type(t) == 'table') and t or {}   -- a damaged cache is calibrated again
end

-- the CPU's cached peak (calibrating and caching it the first time) and where it came from
function M.cpu_peak(path)
  path = path or M.cache_path()
  local key, cache = cpu_key(), read_cache(path)
  local v = cache[key]
  if type(v) == 'number' and v > 0 and v < math.huge then return v, 'cpu, calibrated once, ' .. path end
  v = M.measure_cpu_flops()
  cache[key] = v
  local dir = path:match('^(.*)/[^/]*$')
  if dir then pcall(require('gptlua.checkpoint').mkdir_p, dir) end  -- a failure shows at the write below
  local tmp = ('%s.tmp.%d'):format(path, math.floor(now() * 1e6) % 1e9)
  local f = io.open(tmp, 'wb')
  if f and f:write(cjson.encode(cache)) and f:close() then
    os.rename(tmp, path)   -- atomic: a run that reads it meanwhile sees the old file or the new one
    return v, 'cpu, calibrated now and cached in ' .. path
  end
  os.remove(tmp)
  return v, 'cpu, calibrated now (cannot write ' .. path .. ')'
end

-- peak FLOP/s of the run's device(s, per device) and a phrase saying where it came from
function M.peak_flops(cfg)
  if cfg.peak_flops > 0 then return cfg.peak_flops, 'peak_flops' end
  if cfg.device ~= 'cpu' then
    local ok, cuda = pcall(require, 'gptlua.cuda')
    local okn, name = false, nil
    if ok then okn, name = pcall(cuda.get_device_name, cfg.device) end
    name = okn and tostring(name) or 'unknown GPU'
    local v, key = M.gpu_peak(name)
    if v then return v, ('%s, bf16 dense, table'):format(key) end
    return 989e12, ("'%s' is not in the table: taken as an H100's; set peak_flops"):format(name)
  end
  return M.cpu_peak()
end

function M.fmt_bytes(b)
  if b >= 2 ^ 30 then return string.format('%.2f GiB', b / 2 ^ 30) end
  return string.format('%.1f MiB', b / 2 ^ 20)
end

function M.fmt_time(s)
  if s < 60 then return string.format('%.0fs', s) end
  if s < 3600 then return string.format('%dm%02ds', math.floor(s / 60), math.floor(s % 60)) end
  return string.format('%dh%02dm', math.floor(s / 3600), math.floor(s % 3600 / 60))
end

function M.fmt_flops(f)
  if f >= 1e12 then return string.format('%.0f TFLOP/s', f / 1e12) end
  return string.format('%.1f GFLOP/s', f / 1e9)
end

return M
