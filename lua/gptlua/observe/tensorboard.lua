-- gptlua.observe.tensorboard — TensorBoard event files, written without
-- TensorFlow, so `tensorboard --logdir runs` shows a run's curves.
--
-- An event file (events.out.tfevents.<time>.<host>) is a TFRecord stream:
-- each record is
--     uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
-- (little-endian; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, CRC-32C
-- being the Castagnoli polynomial, reflected 0x82F63B78).  `data` is an
-- Event protocol buffer (tensorflow/core/util/event.proto):
--     Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
--     Summary { repeated Value value = 1; }
--     Value   { string tag = 1; float simple_value = 2; }
-- The first record holds file_version "brain.Event:2"; every later one a
-- Summary of scalars at one step.
--
-- The trainer (gptlua.train) hands every metrics.jsonl record to
-- Writer:write as well: each finite number becomes a scalar tagged
-- train/<key> (eval/<key> for eval records); step, eval flags and the wall
-- clock fields are not scalars.  Records are flushed as they are written,
-- like metrics.jsonl.  Only rank 0 writes (it alone writes metrics).
local ffi = require 'ffi'
local bit = require 'bit'
local band, bor, bxor, rshift, lshift, tobit = bit.band, bit.bor, bit.bxor, bit.rshift, bit.lshift, bit.tobit

local M = {}

-- ------------------------------------------------------------- CRC-32C
local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) ~= 0 then c = bxor(rshift(c, 1), tobit(0x82F63B78)) else c = rshift(c, 1) end
  end
  CRC_TABLE[i] = c
end

-- CRC-32C of the string s, as a non-negative number
function M.crc32c(s)
  local c = tobit(0xFFFFFFFF)
  for i = 1, #s do
    c = bxor(CRC_TABLE[band(bxor(c, s:byte(i)), 0xFF)], rshift(c, 8))
  end
  c = bxor(c, tobit(0xFFFFFFFF))
  return c < 0 and c + 2 ^ 32 or c
end

-- TFRecord's masked CRC of s (stored so that a CRC of data holding CRCs
-- does not degenerate)
function M.masked_crc(s)
  local c = tobit(M.crc32c(s))
  local m = (bor(rshift(c, 15), lshift(c, 17)) % 2 ^ 32 + 0xa282ead8) % 2 ^ 32
  return m
end

-- ------------------------------------------------------- byte encodings
local function u32le(n)
  return string.char(n % 256, math.floor(n / 256) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 16777216) % 256)
end

local function u64le(n) return u32le(n % 2 ^ 32) .. u32le(math.floor(n / 2 ^ 32)) end

local dbuf, fbuf = ffi.new('double[1]'), ffi.new('float[1]')
-- IEEE-754 little-endian bytes (every machine the engine builds for is little-endian)
local function f64le(x) dbuf[0] = x; return ffi.string(dbuf, 8) end
local function f32le(x) fbuf[0] = x; return ffi.string(fbuf, 4) end

local function varint(n)
  local out = {}
  repeat
    local b = n % 128
    n = math.floor(n / 128)
    out[#out + 1] = string.char(n > 0 and b + 128 or b)
  until n == 0
  return table.concat(out)
end

-- protobuf fields: key = field number << 3 | wire type
local function field_bytes(num, s) return varint(num * 8 + 2) .. varint(#s) .. s end
local function field_double(num, x) return varint(num * 8 + 1) .. f64le(x) end
local function field_float(num, x) return varint(num * 8 + 5) .. f32le(x) end
local function field_varint(num, n) return varint(num * 8) .. varint(n) end

-- an Event: wall_time, step, and either file_version or a Summary of
-- scalars ({{tag, value}, ...})
function M.event(wall_time, step, what)
  local body = field_double(1, wall_time) .. field_varint(2, step)
  if type(what) == 'string' then return body .. field_bytes(3, what) end
  local values = {}
  for i, tv in ipairs(what) do
    values[i] = field_bytes(1, field_bytes(1, tv[1]) .. field_float(2, tv[2]))
  end
  return body .. field_bytes(5, table.concat(values))
end

-- one TFRecord around data
function M.record(data)
  local len = u64le(#data)
  return len .. u32le(M.masked_crc(len)) .. data .. u32le(M.masked_crc(data))
end

-- ------------------------------------------------------------- writer
local Writer = {}
Writer.__index = Writer

-- fields of a metrics record that are not curves
local NOT_SCALARS = { step = true, eval = true, skipped = true, time = true, timestamp = true, wall_time = true }

-- the scalars of a metrics record, sorted by tag
function M.scalars(rec)
  local prefix = rec.eval and 'eval/' or 'train/'
  local out = {}
  for k, v in pairs(rec) do
    if not NOT_SCALARS[k] and type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge then
      out[#out + 1] = { prefix .. k, v }
    end
  end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end

-- seconds since the epoch, to the microsecond (gptlua.libc)
local wall_clock = require('gptlua.libc').realtime
M.wall_clock = wall_clock

local function hostname()
  local f = io.open('/proc/sys/kernel/hostname', 'rb')
  local h = f and f:read('*l')
  if f then f:close() end
  h = (h or 'localhost'):gsub('[^%w%.%-_]', '_')
  return h
end

-- Writer(dir): events go to dir/events.out.tfevents.<time>.<host>, made
-- (with dir) at the first write; a second writer in the same second gets
-- its own file (.1, .2, ...) as TensorBoard reads every file of a dir.
function M.Writer(dir)
  return setmetatable({ dir = dir }, Writer)
end

function Writer:open()
  require('gptlua.checkpoint').mkdir_p(self.dir)
  local base = ('%s/events.out.tfevents.%d.%s'):format(self.dir, os.time(), hostname())
  local path, n = base, 0
  while true do
    local f = io.open(path, 'rb')
    if not f then break end
    f:close()
    n = n + 1
    path = base .. '.' .. n
  end
  local f, err = io.open(path, 'wb')
  if not f then error(('tensorboard: cannot write %s (%s)'):format(path, tostring(err)), 0) end
  self.file, self.path = f, path
  f:write(M.record(M.event(wall_clock(), 0, 'brain.Event:2')))
  f:flush()
end

-- writes the scalars of a metrics record (a table as written to
-- metrics.jsonl) at its step; records without scalars write nothing.
-- dir (optional): the directory to write to from now on (a new file there)
function Writer:write(rec, dir)
  if dir and dir ~= self.dir then self:close(); self.dir = dir end
  local scalars = M.scalars(rec)
  if #scalars == 0 then return end
  if not self.file then self:open() end
  local t = tonumber(rec.timestamp) or tonumber(rec.time) or tonumber(rec.wall_time) or wall_clock()
  self.file:write(M.record(M.event(t, tonumber(rec.step) or 0, scalars)))
  self.file:flush()
end

function Writer:close()
  if self.file then self.file:close(); self.file = nil end
end

-- The trainer's writer (rank 0, unless the config says tensorboard =
-- false); Trainer:write_metrics passes it each record with the run
-- directory, so the events land next to metrics.jsonl.
function M.for_trainer(trainer)
  if not trainer.cfg.tensorboard or trainer.rank ~= 0 then return nil end
  return M.Writer(trainer.run_dir)
end

return M
