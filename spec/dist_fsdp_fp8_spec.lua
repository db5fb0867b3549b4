-- FSDP's FP8 all-gather (gptlua.dist.fsdp_fp8) on 2 MPI ranks, FP8 emulated
-- on the CPU (spec/dist/fsdp_fp8.lua runs on the ranks), tensorwise and
-- rowwise, float32 and bfloat16 models:
--   - every FP8 weight's gathered codes and scales, both the forward's
--     (rows) and the input gradient's (columns), equal gl.fp8_quantize of
--     the whole weight in one process, bit for bit;
--   - one step's all-gather bytes: the FP8 weights travel at 1 byte per
--     element where they travelled at the model dtype's 2 or 4 (tensorwise:
--     1/2 of bfloat16's, 1/4 of float32's; rowwise gathers the column form
--     too for backward, 1 + 2 bytes per forward and backward against 2 x 2
--     or 2 x 4), the other parameters' bytes unchanged, plus the amax
--     all-reduce's few bytes;
--   - 5 training steps of the tensor-parallel specs' small GPT (3 blocks,
--     float32) equal one process by spec/support/dist_train.lua's rule.
local H = require 'support.mpi'
local DT = require 'support.dist_train'

local N = 2
local res_cache
local function results()
  if res_cache then return res_cache end
  local out = H.tmpdir()
  local o, rc = H.mpirun(N, 'spec/dist/fsdp_fp8.lua', out, 400)
  H.assert_ranks_ok(o, rc, N)
  res_cache = H.read_json(out .. '/fp8_gather.json')
  os.execute('rm -rf ' .. out)
  return res_cache
end

describe('FSDP all-gathers FP8 weights as float8 codes (2 ranks)', function()
  for _, rc in ipairs({ 'tensorwise', 'rowwise' }) do
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local key = rc .. '_' .. dt
      it(key .. ': gathered codes and scales are one process\'s, bit for bit', function()
        local r = results()[key]
        assert.is_true(r.weights >= 4, 'FP8 weights checked: ' .. r.weights)
        assert.same({}, r.bad)
      end)
      it(key .. ': the FP8 weights\' gather bytes are 1 per element, the rest unchanged', function()
        local r = results()[key]
        local E, b = r.fp8_elements, r.dtype_bytes
        -- 2 micro-steps (one per rank) of a forward gather and backward's re-gather
        local gathers = 4
        local saved = r.off.hp - r.on.hp    -- the FP8 weights' high-precision bytes no longer sent
        assert.equal(E * b * (N - 1) * gathers, saved)
        assert.equal(0, r.off.f8)
        local want = rc == 'tensorwise' and E * (N - 1) * gathers     -- q, whose bytes also serve W^T
          or E * (N - 1) * (gathers / 2 + 2 * gathers / 2)          -- forward: rows; backward: rows and columns
        assert.equal(want, r.on.f8)
        -- the scales' all-reduce: a few bytes per row and column (small beside R x C at real widths)
        assert.is_true(r.on.amax > 0 and r.on.amax <= r.on.f8, 'amax all-reduce bytes ' .. r.on.amax)
        print(('%s: per step on %d ranks, all-gather bytes %d with FP8 codes (%d float8 + %d %s, amax %d), %d without')
          :format(key, N, r.on.f8 + r.on.hp, r.on.f8, r.on.hp, dt, r.on.amax, r.off.hp))
      end)
    end
  end

end)

-- The plan (gptlua --plan: the trainer on the meta device, one rank of a
-- fake world) counts the same bytes: float8 codes at 1 byte each.
describe('the plan counts the FP8 all-gather', function()
  it('FSDP on 4 ranks: the FP8 weights\' gathers move 1 byte per element where they moved 4', function()
    local plan = require 'gptlua.plan'
    local gl = require 'gptlua'
    local S = 4
    local function r()
      local x = dofile(gl.root .. '/recipes/shakespeare.lua')
      x.n_layer, x.n_embd, x.n_head, x.block_size, x.batch_size = 4, 64, 2, 32, 2
      x.dist, x.fp8, x.fp8_emulate, x.dtype = 'fsdp', 'tensorwise', true, 'float32'
      return x
    end
    local function gathered(on)
      local x = r()
      x.fsdp = { fp8_all_gather = on }
      return plan.plan(x, { world = S, device_memory = '1GiB' }).traffic['world.1[0]'].by.all_gather.bytes
    end
    local x = r()
    x.device, x.out_dir = 'cpu', H.tmpdir()
    local t = require('gptlua.train').new(x, {})
    os.execute('rm -rf ' .. x.out_dir)
    local E = 0
    for _, l in ipairs(require('gptlua.fp8').choose(t.model)) do E = E + l.weight:numel() end
    -- forward gather and backward re-gather of the FP8 blocks, (S-1)/S of each sent, 3 bytes fewer per element
    local want = 2 * (S - 1) / S * E * 3
    local saved = gathered(false) - gathered(true)
    assert.is_true(math.abs(saved - want) <= 0.01 * want, ('plan: %d bytes saved, expected %d'):format(saved, want))
  end)
end)

describe('FSDP with FP8 layers trains as one process (2 ranks)', function()
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs, cases = DT.new(out), {}
  -- (rowwise also with blocks kept gathered from forward to backward: the
  -- forward's gather then carries the column-scaled codes)
  for _, v in ipairs({ { 'tensorwise', '' }, { 'rowwise', '' }, { 'rowwise', ' --fsdp.reshard_after_forward=false' } }) do
    cases[#cases + 1] = { ranks = N, model = 'gpt2', reduce = 'float32', recipe = v[1],
      args = ('--dist=fsdp --n_layer=3 --dtype=float32 --fp8=%s --fp8_emulate=true%s'):format(v[1], v[2]) }
  end
  local got
  for i, c in ipairs(cases) do
    it(c.args .. ': losses, gradient norms and parameters by the rule', function()
      got = got or runs:launch(cases)
      runs:check(c, got[i], { n_layer = 3, dtype = 'float32', fp8 = c.recipe, fp8_emulate = true })
    end)
  end
end)

-- The same gather on 2 GPUs through NCCL (in the simulator: 2 CPU ranks,
-- GL_SIM_DEVICES = 2, every kernel under its memory and race checks): the
-- amax, the cast and the gathers run on the device, and the gathered codes
-- and scales equal the CPU's gl.fp8_quantize bit for bit (the twins' rule
-- for quantization: the same float32 operations), the byte counts the CPU
-- run's.
describe('FSDP all-gathers FP8 weights through NCCL #cuda', function()
  local cuda = require 'gptlua.cuda'
  local ngpu = cuda.device_count()
  local sim = ngpu > 0 and cuda.get_device_name(0):find('cuda-sim', 1, true) ~= nil
  if not (sim or ngpu >= N) then
    pending(('needs %d GPUs'):format(N))
    return
  end
  it('codes and scales as the CPU quantizes them, bytes as on the CPU', function()
    local out = H.tmpdir()
    local env = sim and ('env GL_SIM_DEVICES=%d '):format(N) or ''
    local o, rc = H.sh(env .. H.EXE .. (' -n %d spec/dist/fsdp_fp8.lua %s cuda'):format(N, out), 900)
    H.assert_ranks_ok(o, rc, N)
    local got = H.read_json(out .. '/fp8_gather.json')
    os.execute('rm -rf ' .. out)
    local want = results()
    for _, rc_ in ipairs({ 'tensorwise', 'rowwise' }) do
      for _, dt in ipairs({ 'float32', 'bfloat16' }) do
        local key = rc_ .. '_' .. dt
        assert.is_true(got[key].weights >= 4, key)
        assert.same({}, got[key].bad)
        assert.same(want[key].on, got[key].on)
        assert.same(want[key].off, got[key].off)
      end
    end
  end)
end)

describe('FSDP and HSDP all-gather FP8 weights on 4 ranks', function()
  it('gathered codes and scales are one process\'s, bit for bit (FSDP over 4, HSDP shard groups of 2)', function()
    local out = H.tmpdir()
    local o, rc = H.mpirun(4, 'spec/dist/fsdp_fp8.lua', out .. ' cpu codes', 400)
    H.assert_ranks_ok(o, rc, 4)
    local got = H.read_json(out .. '/fp8_gather.json')
    os.execute('rm -rf ' .. out)
    for _, rc_ in ipairs({ 'tensorwise', 'rowwise' }) do
      for _, d in ipairs({ 'fsdp', 'hsdp' }) do
        local r = got[rc_ .. '_' .. d]
        assert.equal(d == 'fsdp' and 4 or 2, r.shard)
        assert.is_true(r.weights >= 4, rc_ .. ' ' .. d)
        assert.same({}, r.bad)
      end
    end
  end)
end)
