-- The byte-and-FLOP account (kernels/sim/account.cpp, recipes/tools/account.lua,
-- `recipes/bench_cuda.lua --account`): what the simulator counts equals an
-- independent count (kernels' bytes = the sizes of the tensors they read and
-- write; the GEMMs' FLOPs = 2mnk from the model's shapes), and the
-- extrapolation from small counted steps equals a direct count at another
-- size.  The counting runs in the account flavour (build/sim-account/gptlua,
-- `make sim-account`) with GL_SIM_SMS=2, in a subprocess (spec/sim/account.lua).
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local S = require 'support.mpi'

local EXE = S.ROOT .. '/build/sim-account/gptlua'

-- runs the worker; returns { key = { counted, expected } } and the output
local function worker(what, limit)
  local out, rc = S.sh(('env GL_SIM_SMS=2 %s spec/sim/account.lua %s'):format(EXE, what), limit)
  assert(rc == 0, ('spec/sim/account.lua %s exited %s:\n%s'):format(what, tostring(rc), out))
  local got = {}
  for key, c, e in out:gmatch('([%w_%.]+) (%S+) (%S+)\n') do got[key] = { tonumber(c), tonumber(e) } end
  return got, out
end

local function expect_all(got, out, keys)
  for _, k in ipairs(keys) do
    assert(got[k], 'no ' .. k .. ' in the output:\n' .. out)
    assert.are.equal(got[k][2], got[k][1], k)
  end
end

describe('cuda-sim account: bytes, FLOPs, syncs of each launch #cuda #sim', function()
  it('is built (make sim-account)', function()
    local f = io.open(EXE, 'rb')
    assert(f, EXE .. ' is missing: make sim-account')
    f:close()
  end)

  it('counts a kernel\'s bytes as the sizes of the tensors it reads and writes, a GEMM as 2mnk', function()
    local got, out = worker('ops', 120)
    expect_all(got, out, { 'add.launches', 'add.read', 'add.written', 'gelu.read', 'gelu.written',
                           'layernorm.read', 'layernorm.written', 'matmul.flops', 'matmul.read', 'matmul.written',
                           'item.syncs_at_least', 'epilogue_gelu.gemm_launches', 'epilogue_gelu.other_launches',
                           'epilogue_dgelu.gemm_launches', 'epilogue_dgelu.other_launches',
                           'epilogue_bgrad.gemm_launches', 'epilogue_bgrad.other_launches', 'add_norm.launches',
                           'add_norm.all_launches', 'add_norm.read', 'add_norm.written' })
  end)

  it('counts a training step\'s GEMM FLOPs as the model\'s shapes give them', function()
    local got, out = worker('step', 300)
    expect_all(got, out, { 'gemm.flops_2mnk_plus_epilogue', 'gemm.launches', 'rows_with_partial_sectors' })
  end)

  it('extrapolates exactly: the fit of eight small steps equals a direct count at a ninth size', function()
    local got, out = worker('extrapolation', 600)
    assert(got['extrapolation.max_rel_error'], out)
    assert(got['extrapolation.max_rel_error'][1] < 1e-9, out)
    -- the embedding lookup's reads depend on how often tokens repeat
    expect_all(got, out, { 'extrapolation.data_dependent_within_30pct' })
  end)

  it('is one command from any engine, which hands it to the account flavour', function()
    local out, rc = S.sh(S.EXE .. ' recipes/bench_cuda.lua --account --model=gpt3', 120)
    assert.are_not.equal(0, rc)
    assert.matches('account: %-%-model expected one of gpt2_124m, nanochat_d20, got gpt3', out)
  end)

  it('refuses to count in a build whose kernels are not instrumented', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    local lib, why = acc.library()
    assert.is_nil(lib)
    assert.matches('make sim%-account', why)
  end)
end)
