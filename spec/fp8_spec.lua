-- float8_e4m3fn and float8_e5m2 tensors: every code decoded, conversions from
-- float64 / float32 / bfloat16 rounding to nearest even with saturation, NaN,
-- printing and safetensors, against a reference written here in Lua from
-- the OCP FP8 definitions (values listed code by code, nearest value found
-- by search, not by bit arithmetic like the engine's).  The CUDA kernels'
-- conversions (kernels/common.cuh over cuda_fp8.h) are compared with the
-- CPU's in the #cuda section.
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local twin = require 'support.cuda_twin'

local ref = require 'support.fp8_ref'
local FORMATS, ref_decode, ref_encode = ref.FORMATS, ref.decode, ref.encode

local function codes_of(t) return t:contiguous():view_dtype('uint8', { t:numel() }):totable() end
local function from_codes(codes, dtype, device)
  local u = gl.tensor(codes, { dtype = 'uint8' })
  local t = u:view_dtype(dtype, { #codes })
  return device and t:to(device) or t
end
local function same_value(a, b) return (a ~= a and b ~= b) or a == b end

-- inputs that probe every rounding decision: each finite value, each
-- midpoint between neighbours and the midpoint nudged either way by `nudge`
-- times its leading power of two (so the source dtype's bits can hold it), both signs; past the largest value; below the smallest
-- subnormal; inf, NaN, -0
local function probes(f, nudge)
  local xs = {}
  local function add(v) xs[#xs + 1] = v; xs[#xs + 1] = -v end
  local function above(v) local _, e = math.frexp(v); return v + 2 ^ (e - 1) * nudge end
  for c = 0, f.max_code do
    local v = ref_decode(f, c)
    add(v)
    if c < f.max_code then
      local mid = (v + ref_decode(f, c + 1)) / 2
      add(mid); add(above(mid)); add(mid - (above(mid) - mid))
    end
  end
  local tiny = ref_decode(f, 1)
  add(tiny / 4); add(above(tiny / 2))
  add(above(f.max)); add(f.max * 1.5); add(f.max * 1024); add(math.huge)
  xs[#xs + 1] = 0 / 0
  return xs
end

for name, f in pairs(FORMATS) do
  describe(name, function()
    it('decodes all 256 codes as the OCP FP8 definition', function()
      local codes = {}
      for c = 0, 255 do codes[c + 1] = c end
      local got = from_codes(codes, name):to('float64'):totable()
      for c = 0, 255 do
        local want = ref_decode(f, c)
        assert(same_value(got[c + 1], want), ('%s code 0x%02x: got %s, expected %s'):format(name, c, got[c + 1], want))
      end
      -- anchors from the spec, in case the reference and the engine share a mistake
      assert.equal(f.max, ref_decode(f, f.max_code))
      assert.equal(1, ref_decode(f, f.ieee and 0x3c or 0x38))
      assert.equal(f.ieee and 2 ^ -16 or 2 ^ -9, ref_decode(f, 1))
      if f.ieee then assert.equal(math.huge, ref_decode(f, 0x7c)) end
    end)

    -- from each source dtype with a nudge it can hold (a midpoint has at
    -- most mbits + 2 significant bits): every value must reach the
    -- conversion exactly, which the test checks before converting
    for src, nudge in pairs({ float64 = 2 ^ -30, float32 = 2 ^ -18, bfloat16 = 2 ^ -7 }) do
      it('rounds from ' .. src .. ' to nearest even and saturates, all codes and midpoints', function()
        local xs = probes(f, nudge)
        local s = gl.tensor(xs, { dtype = 'float64' }):to(src)
        local back = s:to('float64'):totable()
        for i, x in ipairs(xs) do
          assert(same_value(back[i], x), ('%s cannot hold probe %.17g exactly'):format(src, x))
        end
        local got = codes_of(s:to(name))
        for i, x in ipairs(xs) do
          local want = ref_encode(f, x)
          assert(got[i] == want, ('%s from %s: %.17g -> 0x%02x, expected 0x%02x'):format(name, src, x, got[i], want))
        end
      end)
    end

    it('round-trips every finite code through float32 and bfloat16', function()
      local codes = {}
      for c = 0, 255 do
        if ref_decode(f, c) == ref_decode(f, c) and math.abs(ref_decode(f, c)) ~= math.huge then codes[#codes + 1] = c end
      end
      local t = from_codes(codes, name)
      assert.same(codes, codes_of(t:to('float32'):to(name)))
      assert.same(codes, codes_of(t:to('bfloat16'):to(name)))
    end)

    it('prints its values and dtype', function()
      local s = tostring(gl.tensor({ 1, -0.5, f.max, 1e9 }, { dtype = name }))
      assert.truthy(s:find('dtype=' .. name, 1, true), s)
      assert.truthy(s:find(('%.4e'):format(f.max), 1, true) or s:find(('%.4f'):format(f.max), 1, true), s)
      assert.truthy(gl.tensor({ 1 }, { dtype = name }):is_floating())
    end)

    it('is storage for the compute ops: one line saying to convert it', function()
      local ok, e = pcall(gl.softmax, gl.tensor({ 1, 2 }, { dtype = name }), 1)
      assert.is_false(ok)
      assert.truthy(tostring(e):find('has dtype ' .. name .. ", expected float32, float64, bfloat16 or float16 (convert float8 first: t:to('float32'))", 1, true), tostring(e))
    end)

    it('saves and loads in safetensors as ' .. (f.ieee and 'F8_E5M2' or 'F8_E4M3'), function()
      local p = os.tmpname()
      local codes = {}
      for c = 0, 255 do codes[c + 1] = c end
      ckpt.save_safetensors(p, { w = from_codes(codes, name) })
      local fh = io.open(p, 'rb'); local bytes = fh:read('*a'); fh:close()
      assert.truthy(bytes:find('"dtype":"' .. (f.ieee and 'F8_E5M2' or 'F8_E4M3') .. '"', 1, true))
      local back = ckpt.load_safetensors(p).w
      os.remove(p)
      assert.equal(name, back.dtype)
      assert.same(codes, codes_of(back))
    end)
  end)
end

-- the CUDA conversions (cuda_fp8.h's, through kernels/common.cuh's AnyPtr)
-- against the CPU's: every code decoded, every probe encoded, bit for bit
local gpu_it = twin.gpu_it(it, pending)
describe('float8 conversions on the GPU #cuda', function()
  for name, f in pairs(FORMATS) do
    gpu_it(name .. ': decode and encode as the CPU, bit for bit', function()
      local codes = {}
      for c = 0, 255 do codes[c + 1] = c end
      local gdec = from_codes(codes, name, twin.DEV):to('float64'):to('cpu'):totable()
      local cdec = from_codes(codes, name):to('float64'):totable()
      for c = 0, 255 do assert(same_value(gdec[c + 1], cdec[c + 1]), ('%s decode 0x%02x'):format(name, c)) end
      for src, nudge in pairs({ float64 = 2 ^ -30, float32 = 2 ^ -18, bfloat16 = 2 ^ -7 }) do
        local xs = probes(f, nudge)
        local s = gl.tensor(xs, { dtype = 'float64' }):to(src)
        local want = codes_of(s:to(name))
        local got = codes_of(s:to(twin.DEV):to(name):to('cpu'))
        for i, x in ipairs(xs) do
          -- a NaN may keep its sign on a GPU (the toolkit's software path); any NaN code will do
          local ok = got[i] == want[i] or (x ~= x and ref_decode(f, got[i]) ~= ref_decode(f, got[i]))
          assert(ok, ('%s from %s on the GPU: %.17g -> 0x%02x, CPU 0x%02x'):format(name, src, x, got[i], want[i]))
        end
      end
    end)
  end
end)
