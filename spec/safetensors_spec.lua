local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'

local function tmp() return os.tmpname() end
local function write(p, s) local f = io.open(p, 'wb'); f:write(s); f:close() end
local function read(p) local f = io.open(p, 'rb'); local s = f:read('*a'); f:close(); return s end
-- an 8-byte little-endian length, JSON header, payload
local function st_bytes(header, payload)
  local n = #header
  local le = {}
  for i = 1, 8 do le[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(le) .. header .. (payload or '')
end

describe('safetensors', function()
  it('round-trips named tensors of every dtype with metadata', function()
    local p = tmp()
    local ts = {}
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64', 'uint16', 'uint8' }) do
      ts['t_' .. dt] = gl.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, { dtype = dt })
    end
    ts.strided = gl.arange(12, { dtype = 'float32' }):view(3, 4):t()
    ckpt.save_safetensors(p, ts, { format = 'pt', note = 'hello' })
    local back, meta = ckpt.load_safetensors(p)
    assert.equal('hello', meta.note)
    for k, t in pairs(ts) do
      assert.equal(t.dtype, back[k].dtype)
      assert.same(t:totable(), back[k]:totable())
    end
    os.remove(p)
  end)
  it('writes atomically: no temp file is left and an existing file is replaced whole', function()
    local dir = tmp(); os.remove(dir); os.execute('mkdir -p ' .. dir)
    local p = dir .. '/w.safetensors'
    ckpt.save_safetensors(p, { a = gl.ones({ 4 }) })
    ckpt.save_safetensors(p, { a = gl.zeros({ 4 }) })
    local listing = io.popen('ls ' .. dir):read('*a')
    assert.equal('w.safetensors\n', listing)
    assert.same({ 0, 0, 0, 0 }, ckpt.load_safetensors(p).a:totable())
    os.execute('rm -rf ' .. dir)
  end)
  local cases = {
    { 'a missing file', nil, "cannot open" },
    { 'an empty file', '', 'is truncated (0 bytes, no header length)' },
    { 'a header longer than the file', string.char(255, 0, 0, 0, 0, 0, 0, 0) .. '{}', 'header length 255 exceeds the file' },
    { 'a header that is not JSON', st_bytes('{"a": [1,'), 'header is not valid JSON' },
    { 'an entry without data_offsets', st_bytes('{"a":{"dtype":"F32","shape":[1]}}'), "entry 'a' lacks dtype/shape/data_offsets" },
    { 'an unknown dtype', st_bytes('{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}}', '\0\0\0\0'), 'has unsupported dtype Q7' },
    { 'offsets past the data (truncated payload)', st_bytes('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', '\0\0\0\0'),
      'data_offsets [0, 16] fall outside the 4 data bytes' },
    { 'a shape that does not match the byte count', st_bytes('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', '\0\0\0\0'),
      'holds 4 bytes, its shape and dtype need 8' },
    { 'a negative dim', st_bytes('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', '\0\0\0\0'), 'has an invalid size in dim 1' },
    { 'a huge dim', st_bytes('{"a":{"dtype":"F32","shape":[1e300],"data_offsets":[0,4]}}', '\0\0\0\0'), 'has an invalid size in dim 1' },
    { 'overlapping entries', st_bytes('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}', '\0\0\0\0\0\0\0\0'),
      'overlap' },
    { 'a repeated tensor name', st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', '\0\0'),
      "entry name 'a' appears more than once" },
    { 'fractional data offsets', st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0.5,1.5]}}', '\0\0'),
      "entry 'a' data_offsets [0.5, 1.5] must be whole byte offsets" },
    { 'two entries on the same bytes', st_bytes('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', '\0\0\0\0'),
      "entries 'a' and 'b' overlap" },
    { 'a hole between entries', st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}', '\0\0\0'),
      "data_offsets leave data bytes [1, 2) unused before entry 'b'" },
    { 'data bytes past the last entry', st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', '\0\0\0'),
      'data_offsets leave data bytes [1, 3) unused at the end (entries must tile the 3 data bytes)' },
    { 'a metadata value that is not a string', st_bytes('{"__metadata__":{"step":5},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', '\0'),
      "__metadata__ value 'step' must be a string" },
    { 'a repeated __metadata__', st_bytes('{"__metadata__":{},"__metadata__":{},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', '\0'),
      '__metadata__ appears twice' },
    { 'too many dims', st_bytes('{"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}', '\0'), 'has 9 dims, at most 8' },
  }
  for _, c in ipairs(cases) do
    it('rejects ' .. c[1] .. ' with a clear error', function()
      local p = tmp()
      if c[2] then write(p, c[2]) else os.remove(p) end
      local ok, err = pcall(ckpt.load_safetensors, p)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[3], 1, true), 'got: ' .. tostring(err))
      if c[2] then assert.truthy(tostring(err):find(p, 1, true), 'the file is named, got: ' .. tostring(err)) end
      os.remove(p)
    end)
  end
end)

describe('checkpoints', function()
  it('saves into step directories, keeps the last N, and verifies on load', function()
    local dir = tmp(); os.remove(dir)
    for step = 1, 3 do
      ckpt.save(dir, step, { model = { w = gl.full({ 2 }, step) }, optim = {}, state = { note = 'x', config = { n_layer = 1 } } }, 2)
    end
    local all = ckpt.list(dir)
    assert.equal(2, #all)
    assert.equal(3, all[2].step)
    local c = ckpt.load(ckpt.resolve('latest', dir))
    assert.same({ 3, 3 }, c.model.w:totable())
    -- flip a byte: verification refuses the file
    local p = all[2].path .. '/model.safetensors'
    local s = read(p)
    write(p, s:sub(1, -2) .. string.char((s:byte(-1) + 1) % 256))
    local ok, err = pcall(ckpt.load, all[2].path)
    assert.is_false(ok)
    assert.truthy(err:find('failed verification', 1, true))
    local ok2, err2 = pcall(ckpt.load, dir .. '/nope')
    assert.is_false(ok2)
    assert.truthy(err2:find('is not a checkpoint', 1, true))
    os.execute('rm -rf ' .. dir)
  end)
end)
