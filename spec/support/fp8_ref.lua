-- The float8 reference the FP8 specs share (spec/fp8_spec.lua,
-- spec/fp8_product_spec.lua), written from the OCP FP8 definitions: values
-- code by code, and rounding as a search for the nearest value, not bit
-- arithmetic like the engine's (engine/util.c) or the simulator's
-- (spec/cudasim/cuda_fp8.h).
local M = {}

-- the formats: stored mantissa bits, exponent bias, whether the all-ones
-- exponent is inf/NaN (e5m2, IEEE-like) or only S.1111.111 is NaN (e4m3fn)
local FORMATS = {
  float8_e4m3fn = { mbits = 3, bias = 7, ieee = false, max = 448, max_code = 0x7e },
  float8_e5m2 = { mbits = 2, bias = 15, ieee = true, max = 57344, max_code = 0x7b },
}

-- the value of code c (0..255) by the definition: subnormals 2^(1-bias) * m / 2^mbits,
-- normals 2^(e-bias) * (1 + m / 2^mbits)
local function ref_decode(f, c)
  local sign = c >= 128 and -1 or 1
  local low = c % 128
  local e, m = math.floor(low / 2 ^ f.mbits), low % 2 ^ f.mbits
  local emax_field = 2 ^ (7 - f.mbits) - 1
  if f.ieee and e == emax_field then return m == 0 and sign * math.huge or 0 / 0 end
  if not f.ieee and low == 0x7f then return 0 / 0 end
  if e == 0 then return sign * 2 ^ (1 - f.bias) * m / 2 ^ f.mbits end
  return sign * 2 ^ (e - f.bias) * (1 + m / 2 ^ f.mbits)
end

-- the code x rounds to: NaN -> 0x7f; |x| at or past the largest finite value
-- -> that value (saturation); else the nearest finite value, a tie to the
-- even code; the sign of x (of a zero too) kept
local function ref_encode(f, x)
  if x ~= x then return 0x7f end
  local neg = x < 0 or (x == 0 and 1 / x < 0)
  local a = math.abs(x)
  local best
  if a >= f.max then best = f.max_code
  else
    local bestd = math.huge
    for c = 0, f.max_code do
      local d = math.abs(ref_decode(f, c) - a)
      if d < bestd or (d == bestd and c % 2 == 0) then best, bestd = c, d end
    end
  end
  return best + (neg and 128 or 0)
end

M.FORMATS, M.decode, M.encode = FORMATS, ref_decode, ref_encode

-- the largest absolute error of quantizing a value v of a tensor with this
-- scale_inv: half a unit in the last place at |v| (a relative 2^-(mbits+1)),
-- or half the smallest subnormal (times scale_inv) below the normal range
function M.error_bound(f, v, scale_inv)
  return math.max(math.abs(v) * 2 ^ -(f.mbits + 1), 2 ^ (1 - f.bias - f.mbits) / 2 * scale_inv)
end
return M
