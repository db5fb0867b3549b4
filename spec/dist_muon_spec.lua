-- Muon's 'current' variant (NorMuon, Polar Express, cautious weight decay,
-- nanochat's AdamW groups) sharded: ZeRO-1, ZeRO-2 and FSDP on 2 MPI ranks
-- (spec/dist/muon_variants.lua) against one process over the same global
-- batch; the ranks' state bytes count NorMuon's second moments, each held
-- once; a sharded checkpoint resumes on 2 ranks and in one process.
-- The classic variant's sharding is spec/dist_policy_spec.lua's and
-- spec/dist_fsdp_spec.lua's.
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local H = require 'support.mpi'
local recipe = dofile(H.ROOT .. '/spec/dist/policy_recipe.lua')

local function assert_losses(want, got, what)
  assert.equal(#want, #got, what)
  for i = 1, #want do
    local rel = math.abs(want[i] - got[i]) / math.abs(want[i])
    assert.is_true(rel < 1e-5, ('%s: step %d loss %.9g, expected %.9g (relative error %.2g)'):format(what, i, got[i],
      want[i], rel))
  end
end
local function assert_params(want, got, what)
  local e = H.rel_error(want, got)
  assert.is_true(e < 1e-5, ('%s: final parameters differ, relative error %.3g'):format(what, e))
end

describe("Muon variant 'current' sharded over MPI ranks", function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local function rcp(over)
    local r = recipe({ optimizer = 'nanochat', muon_variant = 'current', muon_weight_decay = 0.1, max_iters = 6,
      total_batch_size = 2 * 16 * 4, checkpoint_interval = 3, keep_last = 5, out_dir = out .. '/one' })
    for k, v in pairs(over or {}) do r[k] = v end
    return r
  end
  local ref       -- one process: losses, parameters, NorMuon elements
  local function reference()
    if ref then return ref end
    local t = train.new(rcp(), {})
    local res = t:run()
    local normuon = 0
    for _, o in ipairs(t.optimizer.optimizers) do
      for _, st in pairs(o.state) do
        if st.second_momentum_buffer then normuon = normuon + st.second_momentum_buffer:numel() end
      end
    end
    ref = { losses = res.losses, params = H.params_of(t.model), normuon = normuon }
    return ref
  end

  it('ZeRO-1, ZeRO-2 and FSDP on 2 ranks equal one process; NorMuon state counted once', function()
    local o, rc = H.mpirun(2, 'spec/dist/muon_variants.lua', out .. '/two 6 zero1,zero2,fsdp', 300)
    H.assert_ranks_ok(o, rc, 2)
    local want = reference()
    assert.is_true(want.normuon > 0)
    for _, pol in ipairs({ 'zero1', 'zero2', 'fsdp' }) do
      local what = pol .. ' on 2 ranks'
      local res = H.read_json(('%s/two/%s.json'):format(out, pol))
      assert_losses(want.losses, res.losses, what)
      assert_params(want.params,
        ckpt.load_safetensors(('%s/two/%s/p/checkpoints/step_0000006/model.safetensors'):format(out, pol)), what)
      -- every matrix's second moment lives on its owner only, and the
      -- policy's byte count includes it (as every other piece of state)
      assert.equal(want.normuon, res.normuon_elements[1] + res.normuon_elements[2], what)
      for r = 1, 2 do
        assert.is_true(res.normuon_elements[r] > 0, what)
        assert.equal(res.state_piece_bytes[r], res.state_bytes[r], what .. ' rank ' .. (r - 1))
      end
    end
  end)

  it('a sharded checkpoint resumes exactly on 2 ranks and assembled in one process', function()
    local ckpt_of = function(pol) return ('%s/two/%s/p/checkpoints/step_0000003'):format(out, pol) end
    local want = reference().losses
    local tail = { want[4], want[5], want[6] }
    for _, pol in ipairs({ 'zero2', 'fsdp' }) do
      local st = H.read_json(ckpt_of(pol) .. '/state.json')
      local found = false
      for k, shape in pairs(st.shards.layout) do
        if k:match('%.second_momentum_buffer$') then found = true; assert.equal(1, math.min(shape[1], shape[2])) end
      end
      assert.is_true(found, pol .. ': the layout records NorMuon state')
      local o, rc = H.mpirun(2, 'spec/dist/muon_variants.lua', ('%s/re_%s 6 %s %s'):format(out, pol, pol, ckpt_of(pol)),
        300)
      H.assert_ranks_ok(o, rc, 2)
      assert_losses(tail, H.read_json(('%s/re_%s/%s.json'):format(out, pol, pol)).losses, pol .. ' resumed on 2 ranks')
      local t = train.new(rcp({ out_dir = out .. '/one_' .. pol }), { '--resume=' .. ckpt_of(pol) })
      assert_losses(tail, t:run().losses, pol .. ' resumed in one process')
    end
  end)
end)
