-- A whole small GPT on the GPU against the same model on the CPU (fp32):
-- forward loss, every gradient, and 10 optimizer steps.  Tagged #cuda: run
-- by `make test-cuda`; without a GPU every test is pending.
local gl = require 'gptlua'
local optim = require 'gptlua.optim'
local HAVE_GPU = gl.cuda_available()
local function gpu_it(name, fn)
  if HAVE_GPU then it(name, fn) else pending(name .. ' (no CUDA device on this machine)') end
end

local function build(kind, seed)
  gl.manual_seed(seed)
  if kind == 'gpt2' then
    return require('gptlua.models.gpt2').GPT({ vocab_size = 97, block_size = 32, n_layer = 2, n_head = 2, n_embd = 64 })
  end
  return require('gptlua.models.nanochat').GPT({ depth = 2, n_embd = 128, n_head = 2, n_kv_head = 1,
                                                 vocab_size = 97, block_size = 32 })
end

local function rel(a, b)
  local d = a:to('cpu'):max_abs_diff(b:to('cpu'))
  local scale = gl.max(gl.abs(b:to('cpu'))):item()
  return d / math.max(scale, 1e-12)
end

describe('whole model on the GPU vs the CPU #cuda', function()
  for _, kind in ipairs({ 'gpt2', 'nanochat' }) do
    gpu_it(kind .. ': loss, all gradients and 10 optimizer steps match in fp32', function()
      local cpu, gpu = build(kind, 11), build(kind, 11)
      gpu:to('cuda:0')
      local data = gl.uniform({ 4, 33 }, 0, 97, { seed = 5, dtype = 'float64' }):clamp_(0, 96):to('int64')
      local x, y = data:narrow(2, 1, 32):contiguous(), data:narrow(2, 2, 32):contiguous()
      local _, lc = cpu:forward(x, y)
      local _, lg = gpu:forward(x:to('cuda:0'), y:to('cuda:0'))
      assert.is_true(math.abs(lc:item() - lg:item()) / lc:item() < 1e-5, ('loss %g vs %g'):format(lc:item(), lg:item()))
      lc:backward(); lg:backward()
      local pc, pg = cpu:named_parameters(), gpu:named_parameters()
      for i, np in ipairs(pc) do
        local r = rel(pg[i][2].grad, np[2].grad)
        assert.is_true(r < 1e-4, np[1] .. ' gradient rel err ' .. r)
      end
      local mk = kind == 'gpt2' and function(m) return optim.AdamW(m:parameters(), { lr = 1e-3 }) end
                                 or function(m) return optim.nanochat(m) end
      local oc, og = mk(cpu), mk(gpu)
      for _ = 1, 10 do
        for _, m in ipairs({ cpu, gpu }) do for _, p in ipairs(m:parameters()) do p.grad = nil end end
        local _, a = cpu:forward(x, y); a:backward(); oc:step()
        local _, b = gpu:forward(x:to('cuda:0'), y:to('cuda:0')); b:backward(); og:step()
      end
      for i, np in ipairs(pc) do
        local r = rel(pg[i][2], np[2])
        assert.is_true(r < 1e-4, np[1] .. ' after 10 steps rel err ' .. r)
      end
    end)
  end
end)
