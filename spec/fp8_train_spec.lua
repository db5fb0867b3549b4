-- The FP8 precision policy (gptlua.fp8, --fp8, --fp8_emulate): which layers
-- it marks, its refusals, the banner and the checkpoint's record, and the
-- default recipe (tiny) trained a few steps with FP8 products emulated on
-- the CPU and, #cuda, on the GPU (the simulator: cuBLASLt's FP8 path).
local gl = require 'gptlua'
local train = require 'gptlua.train'
local fp8 = require 'gptlua.fp8'
local nn = require 'gptlua.nn'
local twin = require 'support.cuda_twin'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

-- the default recipe at a tiny size: 3 blocks, so one (the middle) runs FP8
local function recipe(over)
  local r = dofile(gl.root .. '/recipes/shakespeare.lua')
  r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size = 3, 2, 32, 16, 4
  r.quiet, r.device, r.eval_interval, r.sample_length, r.tensorboard = true, 'cpu', 0, 0, false
  r.max_iters, r.warmup_iters, r.log_interval = 4, 1, 1
  r.out_dir = tmpdir()
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

local function err_of(f)
  local ok, e = pcall(f)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

describe('FP8 policy', function()
  it('marks every linear layer of the blocks but the first and the last, and nothing else', function()
    local t = train.new(recipe({ fp8 = 'tensorwise', fp8_emulate = true }), {})
    local h = t.model.transformer.h
    local marked = 0
    for _, m in ipairs(t.model:modules()) do
      if getmetatable(m) == nn.Linear and m.fp8 then marked = marked + 1 end
    end
    local middle = 0
    for _, m in ipairs(h[2]:modules()) do
      if getmetatable(m) == nn.Linear then assert.equal('tensorwise', m.fp8); middle = middle + 1 end
    end
    assert.is_true(middle >= 4, 'the middle block has ' .. middle .. ' linear layers')
    assert.equal(middle, marked)
    for _, b in ipairs({ h[1], h[3] }) do
      for _, m in ipairs(b:modules()) do assert.is_nil(m.fp8) end
    end
    assert.is_nil(t.model.lm_head.fp8)
    assert.truthy(t.fp8_line:find('fp8 tensorwise: ' .. middle .. ' linear layers of blocks 2-2', 1, true), t.fp8_line)
  end)

  it('refuses in one line: the CPU without --fp8_emulate, an old GPU, an unknown recipe, too few blocks', function()
    assert.equal("config: fp8 'tensorwise' needs a GPU of sm_89 or newer; on the CPU it is emulated only with "
      .. '--fp8_emulate (slow, for checks)', err_of(function() train.new(recipe({ fp8 = 'tensorwise' }), {}) end))
    assert.equal("config: fp8 must be 'off', 'tensorwise' or 'rowwise', got 'mxfp8'",
      err_of(function() train.new(recipe({ fp8 = 'mxfp8', fp8_emulate = true }), {}) end))
    assert.equal("fp8 'rowwise' needs a GPU of sm_89 or newer (FP8 tensor cores), cuda:0 is sm_86",
      fp8.refusal({ fp8 = 'rowwise', device = 'cuda:0' }, 8, 6))
    assert.is_nil(fp8.refusal({ fp8 = 'rowwise', device = 'cuda:0' }, 8, 9))
    assert.truthy(err_of(function() train.new(recipe({ fp8 = 'rowwise', fp8_emulate = true, n_layer = 2 }), {}) end)
      :find('the model has 2 blocks; FP8 leaves the first and the last in high precision, so it needs at least 3', 1, true))
  end)

  for _, r in ipairs({ 'tensorwise', 'rowwise' }) do
    it(r .. ' trains the default recipe on the CPU (emulated): finite losses near bf16-free float32, recorded in the checkpoint', function()
      local res, t = train.main(recipe({ fp8 = r, fp8_emulate = true, checkpoint_interval = 4 }), {})
      local ref = train.main(recipe({}), {})
      assert.equal(#ref.losses, #res.losses)
      local differs = false
      for i, l in ipairs(res.losses) do
        assert.is_true(l == l and l < 10, 'loss ' .. i .. ' is ' .. l)
        -- the first step's loss: one block of 3 in FP8 moves it by FP8's rounding, not more
        if i == 1 then assert.is_true(math.abs(l - ref.losses[1]) < 0.05 * ref.losses[1], l .. ' vs ' .. ref.losses[1]) end
        if l ~= ref.losses[i] then differs = true end
      end
      assert.is_true(differs, 'the FP8 run took exactly the float32 run\'s losses')
      local ckpt = require 'gptlua.checkpoint'
      t:close_checkpoint_writer()
      local st = ckpt.load(ckpt.resolve('latest', t.ckpt_dir))
      assert.equal(r, st.state.config.fp8)
    end)
  end
end)

-- pipeline stages: the policy is the whole model's (blocks 2 .. n-1 of
-- all n, whichever stage holds them), so the banner and the checkpoint's
-- record are one process's; tp, cp and pp against one process: the
-- composition matrix (spec/composition_spec.lua)
describe('FP8 under pipeline parallelism', function()
  local H = require 'support.mpi'
  if not H.MPIRUN then
    it('needs mpirun (#mpi)', function() pending('mpirun not found') end)
    return
  end
  it('pp 2: the banner names the global blocks 2-3 of 4 and the checkpoint records the recipe', function()
    local out = tmpdir()
    local o, rc = H.sh(H.EXE .. ' -n 2 recipes/shakespeare.lua --pp=2 --fp8=rowwise --fp8_emulate --n_layer=4 --n_head=2 '
      .. '--n_embd=32 --block_size=16 --batch_size=4 --max_iters=2 --eval_interval=0 --sample_length=0 '
      .. '--checkpoint_interval=2 --out_dir=' .. out, 120)
    assert.equal(0, rc, o)
    -- nanochat's blocks: 6 linear layers each (q, k, v, attention's and the MLP's two)
    local line = o:match('fp8 rowwise: [^\n]*')
    assert.truthy(line, o)
    assert.truthy(line:find('12 linear layers of blocks 2-3', 1, true), line)
    assert.truthy(line:find('blocks 1 and 4 stay float32', 1, true), line)
    local _, n = o:gsub('fp8 rowwise: ', '')
    assert.equal(1, n, 'the banner line once (rank 0): ' .. o)
    local ckpt = require 'gptlua.checkpoint'
    local st = ckpt.load(ckpt.resolve('latest', out .. '/shakespeare/checkpoints'))
    assert.equal('rowwise', st.state.config.fp8)
    os.execute('rm -rf ' .. out)
  end)
end)

local gpu_it = twin.gpu_it(it, pending)
describe('FP8 training on the GPU #cuda', function()
  gpu_it('tensorwise trains the default recipe in bfloat16 through cuBLASLt FP8 products (a CUDA graph)', function()
    local res, t = train.main(recipe({ fp8 = 'tensorwise', device = 'cuda:0', max_iters = 3 }), {})
    assert.equal('bfloat16', t.cfg.dtype)
    for i, l in ipairs(res.losses) do assert.is_true(l == l and l < 10, 'loss ' .. i .. ' is ' .. l) end
  end)

  -- the scales live on the device (no host wait), so the step captures and
  -- replays as one CUDA graph, bit for bit as launched op by op
  gpu_it('rowwise: the step replays as one CUDA graph, as the same steps op by op', function()
    local function trainer(warmup)
      return train.new(recipe({ fp8 = 'rowwise', device = 'cuda:0', cuda_graph = true, cuda_graph_warmup = warmup }), {})
    end
    local graphed, eager = trainer(1), trainer(100)
    for s = 1, 3 do
      local la, na = graphed:train_step()
      local lb, nb = eager:train_step()
      assert.are.equal(lb, la, 'loss of step ' .. s)
      assert.are.equal(nb, na, 'gradient norm of step ' .. s)
    end
    assert.is_truthy(graphed.graph.g, 'the graphed trainer captured')
    graphed.graph:free()
  end)
end)
