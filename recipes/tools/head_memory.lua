-- recipes/tools/head_memory.lua — the fused LM head's memory saving, measured:
-- the allocator's peak over one micro-step (forward + backward) of a small
-- bf16 GPT-2 with GPT-2's vocabulary, once through the fused head
-- (gl.linear_cross_entropy) and once through the unfused one (a linear
-- other than gl.linear makes models/common.lua's head take that path).
--   build/gptlua recipes/tools/head_memory.lua [B [T]]     (default 8 64)
local gl = require 'gptlua'
local common = require 'gptlua.models.common'
local B, T, V = tonumber(arg and arg[1]) or 8, tonumber(arg and arg[2]) or 64, 50304
local function run(fused)
  gl.manual_seed(1)
  local m = require('gptlua.models.gpt2').GPT({ vocab_size = V, block_size = T, n_layer = 1, n_head = 2, n_embd = 64 })
  m:to('bfloat16')
  local idx = gl.uniform({ B, T }, 0, V - 1, { seed = 2, dtype = 'float64' }):to('int64')
  local head = common.head
  if not fused then
    common.head = function(model, x, targets, linear, weight, softcap)
      return head(model, x, targets, function(a, w) return gl.linear(a, w) end, weight, softcap)
    end
  end
  collectgarbage(); collectgarbage()
  local base = gl.memory_stats().allocated
  gl.reset_peak_memory()
  gl.scope(function() local _, loss = m:forward(idx, idx); loss:backward(nil, { free_activations = true }) end)
  common.head = head
  return gl.memory_stats().peak - base
end
local unfused, fused = run(false), run(true)
print(('B=%d T=%d V=%d bf16: peak of a micro-step unfused %.2f MB, fused %.2f MB, saved %.2f MB; 4*B*T*V = %.2f MB, one chunk (8192 rows) of logits %.2f MB'):format(
  B, T, V, unfused / 1e6, fused / 1e6, (unfused - fused) / 1e6, 4 * B * T * V / 1e6, 2 * math.min(8192, B * T) * V / 1e6))
