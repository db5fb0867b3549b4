-- The rule the #cuda kernel twins are checked by (spec/support/cuda_twin.lua):
-- the kernel's error against a float64 reference within 2x the CPU twin's
-- own error in the same precision plus (eps(dtype) + eps(acc) sqrt(n)) at the
-- result's scale; integers exactly; fixed seeds unless GL_CUDA_SPEC_SEED;
-- where no higher precision measures the twin's error, its stand-ins.
-- Runs on the CPU: the "kernel" results here are made up around a reference.
local gl = require 'gptlua'
local twin = require 'support.cuda_twin'

local function fails(f, pattern)
  local ok, err = pcall(f)
  assert.is_false(ok, 'expected the check to fail')
  if pattern then assert.matches(pattern, tostring(err), 1, true) end
end

describe('the kernel twins\' rule', function()
  -- a float64 reference, its bfloat16 rounding (the twin) and a kernel result
  -- that is off by a chosen amount at one element
  local ref = gl.randn({ 64, 33 }, { seed = 3, dtype = 'float64' })
  local twin_bf = ref:to('bfloat16')
  local e_twin = twin_bf:to('float64'):max_abs_diff(ref)
  local scale = ref:abs():max():item()
  local function off_by(d)
    local t = ref:clone()
    t:narrow(1, 5, 1):narrow(2, 7, 1):add_(d)
    return t
  end

  it('takes the dtype\'s epsilon and the reduction length from the arithmetic', function()
    assert.equal(2 ^ -7, twin.EPS.bfloat16)
    assert.equal(2 ^ -23, twin.EPS.float32)
    assert.near((2 ^ -7 + 2 ^ -23 * 10) * 3, twin.bound('bfloat16', 100, 3), 1e-15)
    assert.near((2 ^ -52 + 2 ^ -52 * 2) * 1, twin.bound('float64', 4, 1), 1e-30)
  end)

  it('passes a kernel that rounds like the twin, fails one off by more than 2x the twin\'s error + the bound', function()
    twin.check('same rounding', twin_bf, twin_bf, ref, 'bfloat16', 1)
    local allowed = 2 * e_twin + twin.bound('bfloat16', 1, scale)
    twin.check('just inside', off_by(0.99 * allowed), twin_bf, ref, 'bfloat16', 1)
    fails(function() twin.check('just outside', off_by(1.01 * allowed), twin_bf, ref, 'bfloat16', 1) end,
      'just outside: max |gpu - ref|')
    -- the message names the seed and the command that repeats the run
    fails(function() twin.check('x', off_by(1.01 * allowed), twin_bf, ref, 'bfloat16', 1) end,
      ('run seed %d; repeat: GL_CUDA_SPEC_SEED=%d'):format(twin.RUN_SEED, twin.RUN_SEED))
  end)

  it('takes the twin\'s error at least as large as what its inputs\' rounding makes of the reference', function()
    -- a twin that rounds luckily (exact here) and a reference on inputs moved by u: the latter counts
    local b = twin.bound('bfloat16', 1, scale)
    local refp = off_by(b)
    twin.check('inputs', off_by(2.5 * b), ref, ref, 'bfloat16', 1, nil, refp)  -- allowed 2 b + b
    fails(function() twin.check('inputs', off_by(2.5 * b), ref, ref, 'bfloat16', 1) end, 'inputs: max |gpu - ref|')
  end)

  it('fails NaN, a wrong shape and an integer that differs', function()
    local nan = ref:clone(); nan:narrow(1, 1, 1):fill_(0 / 0)
    fails(function() twin.check('nan', nan:to('bfloat16'), twin_bf, ref, 'bfloat16', 1) end, 'nan: max |gpu - ref| = nan')
    fails(function() twin.check('shape', twin_bf:narrow(1, 1, 63), twin_bf, ref, 'bfloat16', 1) end, 'shape: shape')
    local ids = gl.tensor({ 1, 2, 3 }, { dtype = 'int64' })
    twin.check('ids', ids:clone(), ids, nil, 'float32', 1)
    fails(function() twin.check('ids', gl.tensor({ 1, 2, 4 }, { dtype = 'int64' }), ids, nil, 'float32', 1) end,
      'ids (exact)')
  end)

  it('without a float64 form holds the kernel to 4 bounds of the twin', function()
    local t32 = ref:to('float32')
    local b = twin.bound('float32', 1, t32:abs():max():item())
    twin.check('inside', off_by(3.5 * b):to('float32'):to('float64'), t32:to('float64'), nil, 'float32', 1)
    fails(function() twin.check('outside', off_by(4.5 * b), t32:to('float64'), nil, 'float32', 1) end,
      'outside: max |gpu - twin|')
  end)

  it('in a float64 run takes the twin\'s error from the same body in float32, scaled to float64', function()
    -- 1 - x^2 near x = 1 amplifies its roundings: the float32 run shows by how much
    local x = gl.tensor({ 0.999, 0.9995, 0.5 }, { dtype = 'float64' })
    local function f(t) return 1 - t * t end
    local ref, t32 = f(x), f(x:to('float32')):to('float64')
    local e_t = t32:max_abs_diff(ref) * 2 ^ -52 / 2 ^ -23
    local allowed = 3 * e_t + twin.bound('float64', 1, ref:abs():max():item())
    local function off(d) local t = ref:clone(); t:narrow(1, 2, 1):add_(d); return t end
    twin.check('inside', off(0.9 * allowed), ref, ref, 'float64', 1, t32)
    fails(function() twin.check('outside', off(1.1 * allowed), ref, ref, 'float64', 1, t32) end,
      'outside: max |gpu - twin|')
  end)

  it('checks numbers (C doubles) as float64 results', function()
    twin.check('sum', 1 + 2 ^ -52, 1, 1, 'float32', 1)
    fails(function() twin.check('sum', 1 + 1e-12, 1, 1, 'float32', 1) end, 'sum: max |gpu - twin|')
  end)

  it('draws the same inputs every run unless GL_CUDA_SPEC_SEED says otherwise', function()
    local function seed_of(value)  -- the harness's run seed in a fresh process
      local p = io.popen(('cd %s && %s %s -e "package.path = \'spec/?.lua;\' .. package.path; '
        .. 'print(require(\'support.cuda_twin\').RUN_SEED)" 2>&1'):format(GPTLUA.root,
        value and ('env GL_CUDA_SPEC_SEED=' .. value) or 'env -u GL_CUDA_SPEC_SEED', GPTLUA.exe))
      local out = p:read('*a'); p:close()
      return out
    end
    assert.equal(twin.DEFAULT_SEED .. '\n', seed_of(nil))
    assert.equal('912890000\n', seed_of('912890000'))
    assert.matches('GL_CUDA_SPEC_SEED is "12x", expected a non-negative integer', seed_of('12x'), 1, true)
  end)
end)
