-- recipes/tools/layer_passes.lua — one layer's activation passes (nanochat's or GPT-2's),
-- kernel by kernel, forward and backward, counted by the simulator's account
-- (the breakdown behind the account's "activation passes per layer" line;
-- recipes/tools/ACCOUNT.md).
--   build/gptlua recipes/tools/layer_passes.lua [--model=nanochat|gpt2] [--C=1280] [--H=10] [--T=64] [--V=256]
--                                              [--before=1]
--     (GPT-2's width and heads default to 768 and 12)
--     (needs `make sim-account`; GL_SIM_SMS=2 is set by handing over as bench_cuda.lua does)
-- A pass is one (B, T, C) bfloat16 activation read or written.  One layer's
-- token-proportional bytes are isolated by counting a forward (with its loss)
-- and its backward at 1 and 2 layers and at B = 1 and 2: (L2 - L1) at B = 2
-- minus the same at B = 1 leaves the bytes one layer moves for B*T more tokens
-- (parameter-sized traffic, the gradients' first writes into .grad, cancels).
-- cuBLASLt's products are left out as in the account (their operands are the
-- GEMMs' bytes, not activation passes).  The GEMMs are counted, not run
-- (the account's quick mode).  --before=1 counts the layer as it was before
-- the fusions of spec/layer_fusion_spec.lua's opening comment: rotary and the
-- QK-norm as two ops each way, no norm or linear layer taking over its
-- input's other gradient (autograd adds the two in a pass of its own), and
-- nanochat's block with its residual adds outside the products.
local gl = require 'gptlua'
local acc = dofile(gl.root .. '/recipes/tools/account.lua')
local models = { nanochat = require 'gptlua.models.nanochat', gpt2 = require 'gptlua.models.gpt2' }

local opts = { model = 'nanochat', C = 0, H = 0, T = 64, V = 256, before = 0 }
for _, a in ipairs({ ... }) do
  local k, v = a:match('^%-%-(%w+)=(%w+)$')
  if not k or opts[k] == nil then
    error('layer_passes: unknown argument ' .. a .. ' (--model= --C= --H= --T= --V= --before=)', 0)
  end
  opts[k] = k == 'model' and v or tonumber(v)
end
if not models[opts.model] then error('layer_passes: --model expected nanochat or gpt2, got ' .. opts.model, 0) end
local gpt2 = opts.model == 'gpt2'
if opts.C == 0 then opts.C = gpt2 and 768 or 1280 end
if opts.H == 0 then opts.H = gpt2 and 12 or 10 end

local lib = acc.library()
if not lib or os.getenv('GL_SIM_SMS') ~= tostring(acc.SMS) then
  if os.getenv('GL_ACCOUNT_HANDED') then error('layer_passes: this engine cannot count (make sim-account)', 0) end
  local args = { 'GL_SIM_SMS=' .. acc.SMS, 'GL_SIM_STREAMS=sync', 'GL_ACCOUNT_HANDED=1',
                 gl.root .. '/build/sim-account/gptlua', gl.root .. '/recipes/tools/layer_passes.lua', ... }
  local ok = os.execute(table.concat(args, ' '))
  if ok ~= 0 and ok ~= true then os.exit(1) end
  return
end
lib.gl_sim_account_skip_products(1)

if opts.before == 1 then
  gl.rope_rms_norm = function(x, cos, sin, eps) return gl.rms_norm(gl.rope(x, cos, sin), nil, eps) end
  for _, name in ipairs({ 'rms_norm', 'layer_norm', 'linear' }) do
    local f = gl[name]
    gl[name] = function(...)
      local y = f(...)
      if y.grad_fn then y.grad_fn.adds_into = nil end
      return y
    end
  end
end

-- { fwd = rows, bwd = rows } of one step of an L-layer model at batch B
local function count(L, B)
  gl.manual_seed(1)
  local cfg = { n_layer = L, n_embd = opts.C, n_head = opts.H, vocab_size = opts.V, block_size = opts.T }
  if not gpt2 then cfg.depth = L end
  local m = models[opts.model].GPT(cfg)
  if opts.before == 1 and not gpt2 then
    -- nanochat's block as it was: x + attn fused with the second norm, s + mlp a pass of its own
    getmetatable(m.transformer.h[1]).forward = function(self, x, cache, ve)
      local rot, eps = self.rotary, self.eps or 1e-6
      local h0 = gl.rms_norm(x, nil, eps)
      local s, h = gl.add_rms_norm(x, self.attn(h0, rot.cos, rot.sin, cache, ve, eps), nil, eps)
      return s + self.mlp(h)
    end
  end
  m:to('cuda:0'); m:to('bfloat16')
  math.randomseed(2)
  local ids = {}
  for b = 1, B do
    ids[b] = {}
    for t = 1, opts.T do ids[b][t] = math.random(0, opts.V - 1) end
  end
  local idx = gl.tensor(ids, { dtype = 'int64' }):to('cuda:0')
  local function step(counted)
    for _, p in ipairs(m:parameters()) do p.grad = nil end
    local loss
    local f = function() local _, l = m:forward(idx, idx); loss = l end
    local b = function() loss:backward() end
    if not counted then f(); b(); return end
    return { fwd = acc.count(f).rows, bwd = acc.count(b).rows }
  end
  step(false)  -- warm-up: plans and cuBLASLt's heuristics
  return step(true)
end

local c = { [1] = { count(1, 1), count(2, 1) }, [2] = { count(1, 2), count(2, 2) } }
local act = opts.T * opts.C * 2  -- one (B = 1 more, T, C) bf16 activation
local function layer(part, name, field)
  local function v(B, L) local r = c[B][L][part][name]; return r and r[field] or 0 end
  return (v(2, 2) - v(2, 1)) - (v(1, 2) - v(1, 1))
end

print(('%s layer at C=%d, %d heads, T=%d%s: passes per layer (one (B,T,C) bf16 activation = 1)'):format(
  opts.model, opts.C, opts.H, opts.T, opts.before == 1 and ', before the fusions' or ''))
local total = 0
for _, part in ipairs({ 'fwd', 'bwd' }) do
  local names, seen = {}, {}
  for _, L in ipairs({ 1, 2 }) do
    for n in pairs(c[2][L][part]) do if not seen[n] then seen[n] = true; names[#names + 1] = n end end
  end
  table.sort(names)
  local sum = 0
  print(('%-8s %-46s %9s %8s %8s %8s'):format(part, 'kernel', 'launches', 'read', 'written', 'passes'))
  for _, n in ipairs(names) do
    if not acc.is_gemm(n) and n:sub(1, #acc.SYNC) ~= acc.SYNC then
      local r, w = layer(part, n, 'read') / act, layer(part, n, 'written') / act
      local launches = c[2][2][part][n] and c[2][2][part][n].launches - (c[2][1][part][n] or { launches = 0 }).launches or 0
      if math.abs(r + w) > 0.005 then
        print(('%-8s %-46s %9d %8.2f %8.2f %8.2f'):format('', n:sub(1, 46), launches, r, w, r + w))
        sum = sum + r + w
      end
    end
  end
  print(('%-8s %-46s %9s %8s %8s %8.2f'):format('', 'total ' .. part, '', '', '', sum))
  total = total + sum
end
print(('activation passes per layer: %.1f'):format(total))
