-- A whole small GPT on the GPU against the same model on the CPU: forward
-- loss, every gradient, and 10 optimizer steps, in float32 and in bfloat16
-- with float32 master weights.  Tagged #cuda: run by `make test` under the
-- CUDA simulator (build/sim/gptlua) and by `make test-cuda` on a real GPU.
--
-- Tolerances come from the kernel twins' rule (spec/support/cuda_twin.lua):
-- the same model runs three times, on the CPU in float64 (the reference),
-- on the CPU in the run's precision (the twin) and on the GPU, and the GPU's
-- error against the reference may be at most twice the twin's plus one
-- rounding at the result's scale and a sum of n terms (n the longest
-- reduction in the model).  The loss (at every step) and every gradient
-- are checked by the rule itself.  After 10 steps the parameters are checked
-- by their mean error over the whole model (mean |gpu - ref| <= 2 mean
-- |twin - ref| + the same bound at the mean magnitude): AdamW divides by the
-- root of the second moment, so a gradient that is rounding noise on every
-- side (near zero) takes whole steps of either sign; such elements differ
-- by the learning rate on the twin and the GPU alike, by chance, and only
-- their share over many elements is the same on both, not their count in
-- one small tensor (a bias).  The kernels' own twin specs check each
-- update exactly; this checks that the steps compose.  The twin runs Muon's Newton-Schulz in the precision the GPU does
-- (bfloat16 for bf16 parameters, optim.ns_dtype), so that the two make the
-- same roundings in another order.
-- One slice is left out of the parameter comparison: GPT-2's key bias
-- (c_attn.bias, second third).  Its gradient is exactly zero in exact
-- arithmetic (q . (k + b) shifts every score of a row by the same q . b,
-- which softmax ignores), so what it holds is rounding noise that AdamW
-- normalises into real steps, differently on each device and the reference.
-- Its gradient is still compared (noise-sized on every side).
local gl = require 'gptlua'
local optim = require 'gptlua.optim'
local twin = require 'support.cuda_twin'
local gpu_it = twin.gpu_it(it, pending)

local CONFIG = {
  gpt2 = { vocab_size = 97, block_size = 32, n_layer = 2, n_head = 2, n_embd = 64 },
  nanochat = { depth = 2, n_embd = 128, n_head = 2, n_kv_head = 1, vocab_size = 97, block_size = 32 },
  -- recipes/moe.lua's layer at this size: 4 experts of width 2 n_embd, top-2, sigmoid scores, a balancing loss
  gpt2_moe = { vocab_size = 97, block_size = 32, n_layer = 2, n_head = 2, n_embd = 64,
               moe = { experts = 4, top_k = 2, hidden = 128, router = 'sigmoid', aux_loss = 1e-2 } },
}
local function build(kind, seed)
  gl.manual_seed(seed)
  if kind ~= 'nanochat' then return require('gptlua.models.gpt2').GPT(CONFIG[kind]) end
  return require('gptlua.models.nanochat').GPT(CONFIG.nanochat)
end

-- the parameter as compared after the steps (see the header for the key bias)
local function compared(name, p)
  p = p:to('cpu'):to('float64')
  if name:match('attn%.c_attn%.bias$') then
    local C = p.shape[1] / 3
    return gl.cat({ p:narrow(1, 1, C), p:narrow(1, 2 * C + 1, C) }, 1)
  end
  return p
end

local function mean_abs(t) return gl.mean(gl.abs(t)):item() end

-- the rule on the mean error of the parameters after the steps: lists of
-- {name, gpu, twin, ref} (float64 CPU tensors)
local function check_mean(what, params, dtype, n)
  local count, e, e_twin, mag, worst, worst_name = 0, 0, 0, 0, -1, nil
  for _, p in ipairs(params) do
    local k = p[4]:numel()
    local ep, et = mean_abs(p[2] - p[4]), mean_abs(p[3] - p[4])
    e, e_twin, mag, count = e + ep * k, e_twin + et * k, mag + mean_abs(p[4]) * k, count + k
    if ep / math.max(et, 1e-300) > worst then worst, worst_name = ep / math.max(et, 1e-300), p[1] end
  end
  e, e_twin, mag = e / count, e_twin / count, mag / count
  local allowed = 2 * e_twin + twin.bound(dtype, n, mag)
  assert(e == e and e <= allowed, ('%s: mean |gpu - ref| = %.6g, allowed %.6g = 2 x the CPU twin\'s %.6g + %.6g (%s, n = %d; ' ..
    'the largest ratio to the twin\'s: %s, %.3g)'):format(what, e, allowed, e_twin, allowed - 2 * e_twin, dtype, n, worst_name, worst))
end

local function optimizer(kind, m)
  if kind ~= 'nanochat' then return optim.AdamW(m:parameters(), { lr = 1e-3 }) end
  return optim.nanochat(m)
end

-- runs f with Muon's Newton-Schulz in the GPU's precision on the CPU too
local function as_gpu_ns(f)
  local muon = require('gptlua.optim.muon').optim  -- where Muon looks it up
  local ns_dtype = muon.ns_dtype
  muon.ns_dtype = function(p) return p.dtype == 'bfloat16' and 'bfloat16' or nil end
  local ok, err = pcall(f)
  muon.ns_dtype = ns_dtype
  if not ok then error(err, 0) end
end

describe('whole model on the GPU vs the CPU #cuda', function()
  for _, dtype in ipairs({ 'float32', 'bfloat16' }) do
    for _, kind in ipairs({ 'gpt2', 'nanochat', 'gpt2_moe' }) do
      gpu_it(('%s, %s: loss, all gradients and 10 optimizer steps match'):format(kind, dtype), function()
        local ref, cpu, gpu = build(kind, 11), build(kind, 11), build(kind, 11)
        ref:to('float64')
        if dtype ~= 'float32' then cpu:to(dtype); gpu:to(dtype) end
        gpu:to('cuda:0')
        local B, T = 4, 32
        local data = gl.uniform({ B, T + 1 }, 0, 97, { seed = 5, dtype = 'float64' }):clamp_(0, 96):to('int64')
        local x, y = data:narrow(2, 1, T):contiguous(), data:narrow(2, 2, T):contiguous()
        local xg, yg = x:to('cuda:0'), y:to('cuda:0')
        -- the longest reduction: an MLP's hidden width, the vocabulary, or a
        -- weight gradient's sum over the batch's tokens
        local n = math.max(4 * CONFIG[kind].n_embd, CONFIG[kind].vocab_size, B * T)
        local models = { ref = ref, cpu = cpu, gpu = gpu }
        local inputs = { ref = { x, y }, cpu = { x, y }, gpu = { xg, yg } }
        local loss = {}
        for side, m in pairs(models) do
          local _, l = m:forward(inputs[side][1], inputs[side][2])
          l:backward()
          loss[side] = l:to('cpu'):view({ 1 })
        end
        twin.check(kind .. ' loss', loss.gpu, loss.cpu, loss.ref, dtype, n)
        local pr, pc, pg = ref:named_parameters(), cpu:named_parameters(), gpu:named_parameters()
        for i, np in ipairs(pc) do
          assert.equal('cuda:0', pg[i][2].grad.device)
          twin.check(np[1] .. ' gradient', pg[i][2].grad:to('cpu'), np[2].grad, pr[i][2].grad, dtype, n)
        end
        local opt = {}
        for side, m in pairs(models) do opt[side] = optimizer(kind, m) end
        for step = 1, 10 do
          for side, m in pairs(models) do
            for _, p in ipairs(m:parameters()) do p.grad = nil end
            local function one()
              local _, l = m:forward(inputs[side][1], inputs[side][2])
              l:backward()
              opt[side]:step()
              loss[side] = l:to('cpu'):view({ 1 })
            end
            if side == 'cpu' then as_gpu_ns(one) else one() end
          end
          twin.check(('%s loss at step %d'):format(kind, step), loss.gpu, loss.cpu, loss.ref, dtype, n)
        end
        local params = {}
        for i, np in ipairs(pc) do
          assert.equal(dtype, pg[i][2].dtype)
          params[i] = { np[1], compared(np[1], pg[i][2]), compared(np[1], np[2]), compared(np[1], pr[i][2]) }
        end
        check_mean(kind .. ' parameters after 10 steps', params, dtype, n)
      end)
    end
  end

  -- the id checks run on the device; the step's first host wait reports them
  -- (today cross_entropy's count of non-ignored targets, else the loss read)
  gpu_it('a bad target fails at the first host wait, naming the op and the id; the next step runs clean', function()
    local m = build('gpt2', 3)
    m:to('cuda:0')
    local x = gl.zeros({ 1, 8 }, { dtype = 'int64' }):to('cuda:0')
    local y = gl.tensor({ { 1, 2, 3, 4, 5, 97, 6, 7 } }, { dtype = 'int64' }):to('cuda:0')
    local ok, err = pcall(function() local _, loss = m:forward(x, y); return loss:item() end)
    assert.is_false(ok)
    assert.matches('gl_cross_entropy_forward: targets%[5%] is 97, expected 0 <= targets < 97', err)
    local _, good = m:forward(x, x)
    good:backward()
    require('gptlua.cuda').check_flags()
    assert.is_true(good:item() > 0)
  end)
end)
