-- TensorBoard event files (gptlua.observe.tensorboard), read back by a
-- decoder written here from the formats' definitions, independently of the
-- writer: TFRecord framing (uint64 length, masked CRC-32C of the length,
-- data, masked CRC-32C of the data), CRC-32C computed bit by bit (no table),
-- and a generic protocol-buffer walk of the Event / Summary / Value
-- messages.  (As a one-off dev check, pip's tensorboard EventAccumulator
-- read the trainer's files too: same tags, steps and values.)
local ffi = require 'ffi'
local bit = require 'bit'
local tb = require 'gptlua.observe.tensorboard'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

-- ---------------------------------------------------------- the decoder
-- CRC-32C, one bit at a time (Castagnoli, reflected polynomial 0x82F63B78)
local function crc32c(s)
  local crc = 0xFFFFFFFF
  for i = 1, #s do
    crc = bit.bxor(crc, s:byte(i))
    for _ = 1, 8 do
      local lsb = bit.band(crc, 1)
      crc = bit.rshift(crc, 1)
      if lsb == 1 then crc = bit.bxor(crc, 0x82F63B78) end
    end
  end
  crc = bit.bnot(crc)
  return crc < 0 and crc + 4294967296 or crc
end
local function masked(s)
  local c = crc32c(s)
  local rot = (math.floor(c / 32768) + (c % 32768) * 131072) % 4294967296  -- rotate right by 15
  return (rot + 0xa282ead8) % 4294967296
end

local function le(s, i, n)  -- unsigned little-endian integer of n bytes at i
  local v = 0
  for k = n - 1, 0, -1 do v = v * 256 + s:byte(i + k) end
  return v
end

-- the records of a TFRecord file; errors on a bad length or CRC
local function records(bytes)
  local out, i = {}, 1
  while i <= #bytes do
    assert(i + 11 <= #bytes, 'truncated header at byte ' .. i)
    local len = le(bytes, i, 8)
    assert(le(bytes, i + 8, 4) == masked(bytes:sub(i, i + 7)), 'length CRC mismatch at byte ' .. i)
    local data = bytes:sub(i + 12, i + 11 + len)
    assert(#data == len, 'truncated record at byte ' .. i)
    assert(le(bytes, i + 12 + len, 4) == masked(data), 'data CRC mismatch at byte ' .. i)
    out[#out + 1] = data
    i = i + 16 + len
  end
  return out
end

-- a protobuf message as {field number = {values...}}: varints as numbers,
-- fixed64 / fixed32 as raw 8 / 4 byte strings, length-delimited as strings
local function proto(s)
  local fields, i = {}, 1
  local function varint()
    local v, mul = 0, 1
    repeat
      local b = s:byte(i); i = i + 1
      v = v + (b % 128) * mul
      mul = mul * 128
    until b < 128
    return v
  end
  while i <= #s do
    local key = varint()
    local num, wt = math.floor(key / 8), key % 8
    local v
    if wt == 0 then v = varint()
    elseif wt == 1 then v = s:sub(i, i + 7); i = i + 8
    elseif wt == 5 then v = s:sub(i, i + 3); i = i + 4
    elseif wt == 2 then local n = varint(); v = s:sub(i, i + n - 1); i = i + n
    else error('unexpected wire type ' .. wt) end
    fields[num] = fields[num] or {}
    table.insert(fields[num], v)
  end
  return fields
end

local function as_double(b) local d = ffi.new('double[1]'); ffi.copy(d, b, 8); return d[0] end
local function as_float(b) local f = ffi.new('float[1]'); ffi.copy(f, b, 4); return f[0] end

-- the events of a file: {wall_time, step, file_version | scalars = {tag = value}}
local function events(path)
  local f = assert(io.open(path, 'rb'))
  local bytes = f:read('*a')
  f:close()
  local out = {}
  for _, data in ipairs(records(bytes)) do
    local ev = proto(data)
    local e = { wall_time = ev[1] and as_double(ev[1][1]), step = ev[2] and ev[2][1] or 0,
                file_version = ev[3] and ev[3][1] }
    if ev[5] then
      e.scalars = {}
      for _, vbytes in ipairs(proto(ev[5][1])[1] or {}) do
        local v = proto(vbytes)
        e.scalars[v[1][1]] = as_float(v[2][1])
      end
    end
    out[#out + 1] = e
  end
  return out
end

local function event_files(dir)
  local p = io.popen('ls -1 ' .. dir .. ' 2>/dev/null')
  local out = {}
  for name in p:lines() do if name:match('^events%.out%.tfevents%.') then out[#out + 1] = dir .. '/' .. name end end
  p:close()
  return out
end

local function f32(x) local f = ffi.new('float[1]', x); return f[0] end

-- ---------------------------------------------------------------- specs
describe('TensorBoard event files', function()
  it('computes CRC-32C and its mask as the format defines', function()
    assert.equal(0xE3069283, crc32c('123456789'))   -- the CRC-32C check value
    assert.equal(0xE3069283, tb.crc32c('123456789'))
    for _, s in ipairs({ '', 'a', ('\255'):rep(37), 'brain.Event:2' }) do
      assert.equal(crc32c(s), tb.crc32c(s), s)
      assert.equal(masked(s), tb.masked_crc(s), s)
    end
  end)

  it('writes a file version event, then scalars at their steps, each record framed and checked', function()
    local d = tmpdir()
    local w = tb.Writer(d)
    w:write({ step = 10, loss = 2.5, lr = 6e-4, grad_norm = 0.75, tokens_per_sec = 1234.5, run = 'x', timestamp = 1700000000.25 })
    w:write({ step = 20, eval = true, train_loss = 2.25, val_loss = 2.375 })
    w:write({ step = 21, skipped = true, loss = 'nan' })             -- nothing finite: no event
    w:write({ step = 22, loss = 0 / 0, lr = 1e-3 })                  -- NaN left out
    w:close()
    local files = event_files(d)
    assert.equal(1, #files)
    local ev = events(files[1])
    assert.equal(4, #ev)
    assert.equal('brain.Event:2', ev[1].file_version)
    assert.equal(10, ev[2].step)
    assert.equal(1700000000.25, ev[2].wall_time)
    assert.same({ ['train/loss'] = 2.5, ['train/lr'] = f32(6e-4), ['train/grad_norm'] = 0.75,
                  ['train/tokens_per_sec'] = 1234.5 }, ev[2].scalars)
    assert.equal(20, ev[3].step)
    assert.same({ ['eval/train_loss'] = 2.25, ['eval/val_loss'] = 2.375 }, ev[3].scalars)
    assert.equal(22, ev[4].step)
    assert.same({ ['train/lr'] = f32(1e-3) }, ev[4].scalars)
    assert.is_true(ev[4].wall_time > 1.6e9)
    os.execute('rm -rf ' .. d)
  end)

  it('detects a flipped byte (the decoder can fail)', function()
    local rec = tb.record(tb.event(1, 5, { { 'train/loss', 1.5 } }))
    assert.equal(1, #records(rec))
    local bad = rec:sub(1, 20) .. string.char((rec:byte(21) + 1) % 256) .. rec:sub(22)
    assert.has_error(function() records(bad) end)
  end)

  local function recipe(over)
    local r = { name = 't', model = 'gpt2', data = 'char', n_layer = 1, n_head = 2, n_embd = 16, block_size = 8,
                batch_size = 2, max_iters = 4, eval_interval = 2, eval_iters = 1, log_interval = 1, sample_length = 0,
                warmup_iters = 0, quiet = true, device = 'cpu' }
    for k, v in pairs(over) do r[k] = v end
    return r
  end

  it('is written by the trainer beside metrics.jsonl with the same values, and not with tensorboard = false', function()
    local d = tmpdir()
    train.main(recipe({ out_dir = d }), {})
    local files = event_files(d .. '/t')
    assert.equal(1, #files)
    local ev = events(files[1])
    local by_step = {}
    for _, e in ipairs(ev) do
      for k, v in pairs(e.scalars or {}) do by_step[k .. '@' .. e.step] = v end
    end
    local n = 0
    for line in io.lines(d .. '/t/metrics.jsonl') do
      local rec = cjson.decode(line)
      local prefix = rec.eval and 'eval/' or 'train/'
      for k, v in pairs(rec) do
        -- step and the record's time are the event's own fields, not scalars
        if type(v) == 'number' and k ~= 'step' and k ~= 'time' then
          assert.equal(f32(v), by_step[prefix .. k .. '@' .. rec.step], prefix .. k .. ' at ' .. rec.step)
          n = n + 1
        end
      end
    end
    assert.is_true(n >= 4 * 5 + 3 * 2, 'scalars compared: ' .. n)
    local d2 = tmpdir()
    train.main(recipe({ out_dir = d2 }), { '--tensorboard=false' })
    assert.equal(0, #event_files(d2 .. '/t'))
    assert.truthy(io.open(d2 .. '/t/metrics.jsonl'))
    os.execute('rm -rf ' .. d .. ' ' .. d2)
  end)
end)
