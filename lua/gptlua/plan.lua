-- gptlua.plan — the memory planner: per-rank bytes of a training run,
-- worked out from the recipe before anything is allocated.
--
--   gptlua --plan recipe.lua [--world=N] [--device_memory=80GiB] [--margin=0.1] [--key=value ...]
--   local r = require('gptlua.plan').plan(recipe_or_cfg, { world = 8, device_memory = 80 * 2^30 })
--   r.bytes.total, r.fits, r.suggestions, r.text
--
-- Parameter shapes come from the config alone (the same depth dial and
-- defaults as gptlua.models), so a 10B-parameter plan costs nothing.
-- Every byte count is what the engine's caching allocator charges: the
-- request rounded up to its size class (engine/alloc.c; the CUDA path uses
-- the same classes), tensor by tensor.
--
-- Activations model this engine's autograd, op by op (lua/gptlua/ops*.lua):
-- each op's backward closure holds the tensors it reads, so every tensor a
-- forward makes stays alive until backward, and the trainer runs each
-- micro-step inside one tensor scope that releases its tensors only when
-- the micro-step ends.  Only op-internal statistics (norm mean/rstd,
-- attention and cross-entropy log-sum-exp) are released during backward.
-- The activation peak of a micro-batch is therefore
--   forward (everything the forward allocates)
-- + backward temporaries (everything the backward allocates)
-- - the released statistics.
-- With units BTC = B*T*C elements (B micro-batch, T context, C width),
-- BTK = B*T*C*Hkv/H, BT, BTH = B*T*H (H heads), BTV = B*T*V (V vocab); a =
-- bytes per activation (the model dtype), f = bytes per statistic (fp32,
-- fp64 for float64 models), 1 = a one-element tensor (one 512-byte block):
--   gpt2 forward, per layer:      18*BTC*a + 4*BT*f + BTH*f   (+2*BTC*a with dropout)
--     ln_1, qkv (3), attention out, c_proj, residual, ln_2, c_fc (4), gelu (4),
--     c_proj, residual; mean/rstd of both norms, attention lse
--   gpt2 backward, per layer:     18*BTC*a + one temporary per block weight
--     mlp: c_proj dx (4), gelu dx (4), c_fc dx, ln_2 dx, residual grad sum;
--     attn: c_proj dx, dqkv (3), c_attn dx, ln_1 dx, residual grad sum
--   nanochat forward, per layer:  18*BTC*a + 4*BTK*a + 2*BT*f + 2*BTH*f + BTHk*f
--     norm, c_q, c_k/c_v (2 BTK), rope and norm of q, of k (2 BTK),
--     attention out, c_proj, residual, norm, c_fc (4), relu2 (4), c_proj, residual
--   nanochat backward, per layer: 22*BTC*a + 4*BTK*a + one temporary per block weight
--   head forward: final norm BTC*a, logits BTV*a, CE losses/lse 2*BT*f, ignore mask BT*8
--   head backward: dlogits BTV*a, dx of the head and of the final norm 2*BTC*a
--   every parameter: one gradient temporary (a tied embedding three: head,
--   lookup and their sum); they go with the micro-step's scope too.
-- For a big vocabulary the logits and their gradient, 2*B*T*V*a, dominate.
--
-- Activation checkpointing (gl.checkpoint per block) runs the block without
-- recording, but the micro-step's scope still holds what that forward
-- made, and backward recomputes the block and keeps the recomputation plus
-- the input-gradient leaf: per layer + (forward of a layer + BTC*a).  With
-- this engine it costs memory instead of saving it; the plan says so.
--
-- Parameters, gradients, optimizer state (AdamW m+v fp32, Muon momentum
-- fp32), fp32 master weights when the model is bfloat16, and what each
-- rank holds under the sharding policies (N ranks; hsdp: S = shard_size),
-- following gptlua.dist.policies:
--   none      everything whole
--   ddp       everything whole; the gradients are views of the all-reduce
--             buckets (bucket_mb each, in reverse parameter order)
--   zero1     parameters and gradients in flat buckets padded to N*c (the
--             gradients' reduce-scatter fills a c-element shard); AdamW state
--             and master weights for the rank's c elements; AdamW tensors
--             under 1024 elements replicated; Muon matrices stacked by
--             shape, each rank owning ceil(K/N) whole ones.  The step's
--             all-gathers stage a copy of each shard (N > 1)
--   zero2     as zero1, but only the gradient shards persist; two packed
--             buckets are in flight during backward
--   fsdp      one flat buffer per unit (embeddings, each block, head) padded
--             to N: parameters, gradients, AdamW state and master weights
--             ceil(unit/N); gathered: the largest unit and its prefetched
--             neighbour; the unit's full gradients for its reduce-scatter
--   hsdp      fsdp within groups of S ranks, replicated across N/S groups
-- The total is persistent state + the larger of forward/backward
-- (activations, gathered units, buckets in flight) and the optimizer step
-- (Muon's Newton–Schulz temporaries, all-gather staging).
local train = require 'gptlua.train'

local M = {}

M.POLICIES = { 'none', 'ddp', 'zero1', 'zero2', 'fsdp', 'hsdp' }
local POLICY_RANK = { none = 0, ddp = 1, zero1 = 2, zero2 = 3, fsdp = 4, hsdp = 4 }
M.DEFAULT_MARGIN = 0.10
local DTYPE_BYTES = { float32 = 4, float64 = 8, bfloat16 = 2 }
local NS_STEPS = 5                 -- Muon's Newton–Schulz iterations (optim.Muon default)

local function fail(msg) error('plan: ' .. msg, 0) end

-- ------------------------------------------------------------ allocator --
-- Bytes the caching allocator charges for a request of n bytes: 512-byte
-- steps up to 1 MiB, then 8 classes per power of two (engine/alloc.c).
function M.block_bytes(n)
  if n <= 0 then return 0 end
  local s = n < 512 and 512 or n
  if s <= 2 ^ 20 then return math.ceil(s / 512) * 512 end
  local lg = math.floor(math.log(s) / math.log(2))
  if 2 ^ (lg + 1) <= s then lg = lg + 1 elseif 2 ^ lg > s then lg = lg - 1 end
  local step = 2 ^ lg / 8
  return math.ceil(s / step) * step
end
local block = M.block_bytes

-- ------------------------------------------------------------ formatting --
function M.fmt_bytes(b)
  if b >= 2 ^ 40 then return ('%.2f TiB'):format(b / 2 ^ 40) end
  if b >= 2 ^ 30 then return ('%.2f GiB'):format(b / 2 ^ 30) end
  if b >= 2 ^ 20 then return ('%.1f MiB'):format(b / 2 ^ 20) end
  if b >= 2 ^ 10 then return ('%.1f KiB'):format(b / 2 ^ 10) end
  return ('%d B'):format(b)
end
local fmt = M.fmt_bytes

-- "80GiB", "80 GB", "8e10", "512M" -> bytes.  B/KiB/MiB/GiB/TiB and a bare
-- K/M/G/T are powers of 1024; KB/MB/GB/TB are powers of 1000.
function M.parse_bytes(s, what)
  what = what or 'device_memory'
  if type(s) == 'number' then
    if s > 0 then return s end
    fail(('%s must be > 0 bytes, got %s'):format(what, tostring(s)))
  end
  local num, unit = tostring(s):match('^%s*([%d%.eE%+]+)%s*(%a*)%s*$')
  local v = tonumber(num)
  local mult = ({ [''] = 1, b = 1, k = 2 ^ 10, m = 2 ^ 20, g = 2 ^ 30, t = 2 ^ 40,
                  kib = 2 ^ 10, mib = 2 ^ 20, gib = 2 ^ 30, tib = 2 ^ 40,
                  kb = 1e3, mb = 1e6, gb = 1e9, tb = 1e12 })[(unit or ''):lower()]
  if not v or not mult or v <= 0 then
    fail(('%s expects a positive size such as 85899345920, 80GiB or 80GB, got %q'):format(what, tostring(s)))
  end
  return math.floor(v * mult)
end

-- ---------------------------------------------------------------- model --
-- The model's concrete sizes, as gptlua.train.build_model would build it.
local function model_config(cfg)
  if cfg.model == 'gpt2' then
    local common = require 'gptlua.models.common'
    local g = common.fill({ vocab_size = cfg.vocab_size, block_size = cfg.block_size, n_layer = cfg.n_layer,
      n_head = cfg.n_head, n_embd = cfg.n_embd, dropout = cfg.dropout, bias = cfg.bias,
      activation_checkpointing = cfg.activation_checkpointing }, require('gptlua.models.gpt2').defaults, 'gpt2')
    common.check_config(g, 'gpt2')
    g.n_kv_head = g.n_head
    return g
  end
  local mc = { vocab_size = cfg.vocab_size, block_size = cfg.block_size, softcap = cfg.softcap,
               dropout = cfg.dropout, activation_checkpointing = cfg.activation_checkpointing }
  if cfg.depth > 0 then mc.depth = cfg.depth
  else mc.n_layer, mc.n_head, mc.n_embd, mc.depth = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_layer end
  if cfg.n_kv_head > 0 then mc.n_kv_head = cfg.n_kv_head end
  local r = require('gptlua.models.nanochat').resolve(mc)
  r.dropout = 0   -- nanochat's forward has no dropout
  return r
end

-- Parameters in named_parameters() order: {name, shape, numel, unit} where
-- unit is the FSDP wrapping unit (0 embeddings, 1..L blocks, L+1 head),
-- plus buffers {name, numel} and whether the embedding is tied to the head.
function M.model_shapes(cfg)
  local m = model_config(cfg)
  local C, L, V, T = m.n_embd, m.n_layer, m.vocab_size, m.block_size
  local params = {}
  local function p(name, shape, unit)
    local n = 1
    for _, d in ipairs(shape) do n = n * d end
    params[#params + 1] = { name = name, shape = shape, numel = n, unit = unit }
  end
  local out = { kind = cfg.model, n_layer = L, n_head = m.n_head, n_kv_head = m.n_kv_head, n_embd = C,
                vocab_size = V, block_size = T, head_dim = C / m.n_head, dropout = m.dropout,
                params = params, buffers = {} }
  if cfg.model == 'gpt2' then
    local bias = m.bias
    out.tied = true
    p('transformer.wte.weight', { V, C }, 0)
    p('transformer.wpe.weight', { T, C }, 0)
    for i = 0, L - 1 do
      local h = 'transformer.h.' .. i .. '.'
      p(h .. 'ln_1.weight', { C }, i + 1); if bias then p(h .. 'ln_1.bias', { C }, i + 1) end
      p(h .. 'attn.c_attn.weight', { 3 * C, C }, i + 1); if bias then p(h .. 'attn.c_attn.bias', { 3 * C }, i + 1) end
      p(h .. 'attn.c_proj.weight', { C, C }, i + 1); if bias then p(h .. 'attn.c_proj.bias', { C }, i + 1) end
      p(h .. 'ln_2.weight', { C }, i + 1); if bias then p(h .. 'ln_2.bias', { C }, i + 1) end
      p(h .. 'mlp.c_fc.weight', { 4 * C, C }, i + 1); if bias then p(h .. 'mlp.c_fc.bias', { 4 * C }, i + 1) end
      p(h .. 'mlp.c_proj.weight', { C, 4 * C }, i + 1); if bias then p(h .. 'mlp.c_proj.bias', { C }, i + 1) end
    end
    p('transformer.ln_f.weight', { C }, L + 1); if bias then p('transformer.ln_f.bias', { C }, L + 1) end
  else
    local H, Hkv, D = m.n_head, m.n_kv_head, C / m.n_head
    out.tied = false
    p('transformer.wte.weight', { V, C }, 0)
    for i = 0, L - 1 do
      local h = 'transformer.h.' .. i .. '.'
      p(h .. 'attn.c_q.weight', { H * D, C }, i + 1)
      p(h .. 'attn.c_k.weight', { Hkv * D, C }, i + 1)
      p(h .. 'attn.c_v.weight', { Hkv * D, C }, i + 1)
      p(h .. 'attn.c_proj.weight', { C, H * D }, i + 1)
      p(h .. 'mlp.c_fc.weight', { 4 * C, C }, i + 1)
      p(h .. 'mlp.c_proj.weight', { C, 4 * C }, i + 1)
    end
    p('lm_head.weight', { V, C }, L + 1)
    -- rotary tables, (block_size, D/2) each, moved to the model dtype
    out.buffers = { { name = 'rope_cos', numel = T * D / 2 }, { name = 'rope_sin', numel = T * D / 2 } }
  end
  local n = 0
  for _, q in ipairs(params) do n = n + q.numel end
  out.num_params = n
  return out
end

-- Which optimizer updates each parameter (optim.nanochat's split: 2-D
-- matrices inside the blocks go to Muon, everything else to AdamW).
local function optimizer_of(cfg, q)
  if cfg.optimizer == 'nanochat' and q.name:match('^transformer%.h%.') and #q.shape == 2 then return 'muon' end
  return 'adamw'
end

-- ----------------------------------------------------------- activations --
-- Allocation lists: {count, coefficient, unit, dtype tag, what, owned}.
-- owned = released during backward (op-internal statistics).
local function item(n, k, u, t, what, owned) return { n = n, k = k, u = u, t = t, what = what, owned = owned } end

-- The tensors each part of the forward and backward allocates (see the
-- header).  This mirrors the ops in lua/gptlua/ops*.lua and the models'
-- forward; spec/plan_spec.lua checks it byte for byte against the
-- allocator, so a change to either shows there.
local TRACE = {}

function TRACE.gpt2(m)
  local drop = m.dropout > 0 and 1 or 0
  local F = {
    item(1, 1, 'BTC', 'a', 'ln_1'), item(2, 1, 'BT', 'f', 'ln_1 mean/rstd', true),
    item(1, 3, 'BTC', 'a', 'qkv'), item(1, 1, 'BTC', 'a', 'attention out'),
    item(1, 1, 'BTH', 'f', 'attention lse', true),
    item(1, 1, 'BTC', 'a', 'attn c_proj'), item(drop, 1, 'BTC', 'a', 'attn dropout'),
    item(1, 1, 'BTC', 'a', 'residual'), item(1, 1, 'BTC', 'a', 'ln_2'), item(2, 1, 'BT', 'f', 'ln_2 mean/rstd', true),
    item(1, 4, 'BTC', 'a', 'c_fc'), item(1, 4, 'BTC', 'a', 'gelu'), item(1, 1, 'BTC', 'a', 'mlp c_proj'),
    item(drop, 1, 'BTC', 'a', 'mlp dropout'), item(1, 1, 'BTC', 'a', 'residual'),
  }
  local G = {
    item(2 * drop, 1, 'BTC', 'a', 'dropout dx'),
    item(1, 4, 'BTC', 'a', 'mlp c_proj dx'), item(1, 4, 'BTC', 'a', 'gelu dx'), item(1, 1, 'BTC', 'a', 'c_fc dx'),
    item(1, 1, 'BTC', 'a', 'ln_2 dx'), item(1, 1, 'BTC', 'a', 'residual grad sum'),
    item(1, 1, 'BTC', 'a', 'attn c_proj dx'), item(1, 3, 'BTC', 'a', 'dqkv'),
    item(1, 1, 'BTC', 'a', 'c_attn dx'), item(1, 1, 'BTC', 'a', 'ln_1 dx'), item(1, 1, 'BTC', 'a', 'residual grad sum'),
  }
  local EF = { item(1, 1, 'T', 'i64', 'positions'), item(1, 1, 'BTC', 'a', 'wte lookup'),
               item(1, 1, 'TC', 'a', 'wpe lookup'), item(1, 1, 'BTC', 'a', 'embedding sum'),
               item(drop, 1, 'BTC', 'a', 'embedding dropout') }
  local EG = { item(drop, 1, 'BTC', 'a', 'dropout dx'), item(1, 1, 'TC', 'a', 'wpe grad sum') }
  local HF = { item(1, 1, 'BTC', 'a', 'ln_f'), item(2, 1, 'BT', 'f', 'ln_f mean/rstd', true) }
  local HG = { item(1, 1, 'BTC', 'a', 'ln_f dx') }
  return F, G, EF, EG, HF, HG
end

function TRACE.nanochat()
  local F = {
    item(1, 1, 'BTC', 'a', 'norm'), item(1, 1, 'BT', 'f', 'norm rstd', true),
    item(1, 1, 'BTC', 'a', 'c_q'), item(2, 1, 'BTK', 'a', 'c_k, c_v'),
    item(1, 1, 'BTC', 'a', 'rope q'), item(1, 1, 'BTC', 'a', 'norm q'), item(1, 1, 'BTH', 'f', 'norm q rstd', true),
    item(1, 1, 'BTK', 'a', 'rope k'), item(1, 1, 'BTK', 'a', 'norm k'), item(1, 1, 'BTHk', 'f', 'norm k rstd', true),
    item(1, 1, 'BTC', 'a', 'attention out'), item(1, 1, 'BTH', 'f', 'attention lse', true),
    item(1, 1, 'BTC', 'a', 'attn c_proj'), item(1, 1, 'BTC', 'a', 'residual'),
    item(1, 1, 'BTC', 'a', 'norm'), item(1, 1, 'BT', 'f', 'norm rstd', true),
    item(1, 4, 'BTC', 'a', 'c_fc'), item(1, 4, 'BTC', 'a', 'relu2'), item(1, 1, 'BTC', 'a', 'mlp c_proj'),
    item(1, 1, 'BTC', 'a', 'residual'),
  }
  local G = {
    item(1, 4, 'BTC', 'a', 'mlp c_proj dx'), item(1, 4, 'BTC', 'a', 'relu2 dx'), item(1, 1, 'BTC', 'a', 'c_fc dx'),
    item(1, 1, 'BTC', 'a', 'norm dx'), item(1, 1, 'BTC', 'a', 'residual grad sum'),
    item(1, 1, 'BTC', 'a', 'attn c_proj dx'), item(1, 1, 'BTC', 'a', 'dq'), item(2, 1, 'BTK', 'a', 'dk/dv'),
    item(1, 1, 'BTC', 'a', 'norm q dx'), item(1, 1, 'BTC', 'a', 'rope q dx'), item(1, 1, 'BTC', 'a', 'c_q dx'),
    item(1, 1, 'BTK', 'a', 'norm k dx'), item(1, 1, 'BTK', 'a', 'rope k dx'), item(2, 1, 'BTC', 'a', 'c_k/c_v dx'),
    item(2, 1, 'BTC', 'a', 'q/k/v input grad sums'), item(1, 1, 'BTC', 'a', 'norm dx'),
    item(1, 1, 'BTC', 'a', 'residual grad sum'),
  }
  local EF = { item(1, 1, 'BTC', 'a', 'wte lookup'), item(1, 1, 'BTC', 'a', 'norm'),
               item(1, 1, 'BT', 'f', 'norm rstd', true) }
  local EG = { item(1, 1, 'BTC', 'a', 'norm dx') }
  local HF = { item(1, 1, 'BTC', 'a', 'final norm'), item(1, 1, 'BT', 'f', 'final norm rstd', true) }
  local HG = { item(1, 1, 'BTC', 'a', 'final norm dx') }
  return F, G, EF, EG, HF, HG
end

-- the loss head both models share: lm head, cross-entropy, the trainer's
-- loss scaling; one-element tensors cost one 512-byte block each
local function loss_trace()
  local F = { item(1, 1, 'BTV', 'a', 'logits'), item(1, 1, 'BT', 'f', 'CE losses'),
              item(1, 1, 'BT', 'f', 'CE lse', true), item(1, 1, 'BT', 'f64', 'CE ignore mask'),
              item(5, 1, '1', 'f', 'loss scalars') }
  local G = { item(2, 1, '1', 'f', 'loss grads'), item(1, 1, 'BTV', 'a', 'dlogits'),
              item(1, 1, 'BTC', 'a', 'lm head dx') }
  return F, G
end

local function concat(...)
  local out = {}
  for _, list in ipairs({ ... }) do for _, it in ipairs(list) do out[#out + 1] = it end end
  return out
end

local function units(d)
  return { BTC = d.B * d.T * d.C, BTK = d.B * d.T * d.Ck, BT = d.B * d.T, BTH = d.B * d.T * d.H,
           BTHk = d.B * d.T * d.Hk, BTV = d.B * d.T * d.V, TC = d.T * d.C, T = d.T, ['1'] = 1 }
end

-- bytes of an allocation list, and the part released during backward
local function list_bytes(list, u, sizes)
  local total, owned = 0, 0
  for _, it in ipairs(list) do
    if it.n > 0 then
      local b = it.n * block(it.k * u[it.u] * sizes[it.t])
      total = total + b
      if it.owned then owned = owned + b end
    end
  end
  return total, owned
end

-- "18*BTC*a + BTH*f + 4*BT*f" for an allocation list
local TAG_BYTES = { a = 'a', f = 'f', f64 = '8', i64 = '8' }
local UNIT_ORDER = { 'BTV', 'BTC', 'BTK', 'TC', 'BTH', 'BTHk', 'BT', 'T', '1' }
local function formula(list)
  local acc, seen = {}, {}
  local keys = {}
  for _, it in ipairs(list) do
    if it.n > 0 then
      local key = it.u .. '*' .. it.t
      if not acc[key] then acc[key] = 0; keys[#keys + 1] = key; seen[key] = it end
      acc[key] = acc[key] + it.n * it.k
    end
  end
  local rank = {}
  for i, u in ipairs(UNIT_ORDER) do rank[u] = i end
  table.sort(keys, function(a, b)
    local ra, rb = rank[seen[a].u], rank[seen[b].u]
    if ra ~= rb then return ra < rb end
    return a < b
  end)
  local parts = {}
  for _, key in ipairs(keys) do
    local c, it = acc[key], seen[key]
    if it.u == '1' then parts[#parts + 1] = c .. ' scalars'
    else parts[#parts + 1] = (c == 1 and '' or (c .. '*')) .. it.u .. '*' .. TAG_BYTES[it.t] end
  end
  return table.concat(parts, ' + ')
end

-- Activation bytes of one micro-batch for the model m (model_shapes) at
-- micro-batch B; param_temp = bytes of the backward's weight-gradient
-- temporaries (per block and outside the blocks).
local function activations(m, B, sizes, param_temp, checkpointing)
  local d = { B = B, T = m.block_size, C = m.n_embd, H = m.n_head, Hk = m.n_kv_head, V = m.vocab_size,
              Ck = m.n_embd * m.n_kv_head / m.n_head }
  local u = units(d)
  local F, G, EF, EG, HF, HG = TRACE[m.kind](m)
  local LF, LG = loss_trace()
  local f_layer, o_layer = list_bytes(F, u, sizes)
  local g_layer = list_bytes(G, u, sizes)
  local f_emb, o_emb = list_bytes(EF, u, sizes)
  local g_emb = list_bytes(EG, u, sizes)
  local f_head, o_head = list_bytes(HF, u, sizes)
  local g_head = list_bytes(HG, u, sizes)
  local f_loss, o_loss = list_bytes(LF, u, sizes)
  local g_loss = list_bytes(LG, u, sizes)
  local L = m.n_layer
  local forward = f_emb + L * f_layer + f_head + f_loss
  local backward = g_emb + L * g_layer + g_head + g_loss + param_temp
  local released = o_emb + L * o_layer + o_head + o_loss
  local r = { forward = forward, backward = backward - released, layer_forward = f_layer, layer_backward = g_layer,
              logits = block(u.BTV * sizes.a), units = d,
              formula = { layer_forward = formula(F), layer_backward = formula(G),
                          outside_forward = formula(concat(EF, HF, LF)), outside_backward = formula(concat(EG, HG, LG)) } }
  -- checkpointing: the recomputed forward of each layer and the layer's
  -- input-gradient leaf stay too; the no-grad forward's statistics are not
  -- released (only the recomputation's are)
  r.checkpoint_extra = L * (f_layer + block(u.BTC * sizes.a))
  r.checkpointing = checkpointing
  r.total = r.forward + r.backward + (checkpointing and r.checkpoint_extra or 0)
  if checkpointing then r.backward = r.backward + r.checkpoint_extra end
  return r
end

-- ---------------------------------------------------------------- policies
-- What each rank holds, mirroring gptlua.dist.policies: DDP turns every
-- .grad into a view of a flat all-reduce bucket; ZeRO moves parameters
-- into flat buffers padded to a multiple of N (each rank owns a slice),
-- keeps AdamW parameters under 1024 elements replicated, and stacks
-- same-shape Muon matrices (each rank owns ceil(K/N) whole ones).
local function ceil_div(a, b) return math.ceil(a / b) end
local MIN_SHARD = 1024              -- gptlua.dist.policies.zero: smaller tensors stay replicated

-- B.plan of gptlua.dist.policies.base: consecutive runs of at most
-- cap_bytes (a larger tensor forms a bucket alone) -> list of element counts
local function buckets(list, cap_bytes, bytes_per)
  local out, cur, bytes = {}, nil, 0
  for _, q in ipairs(list) do
    local nb = q.numel * bytes_per
    if cur == nil or (cur > 0 and bytes + nb > cap_bytes) then
      if cur then out[#out + 1] = cur end
      cur, bytes = 0, 0
    end
    cur, bytes = cur + q.numel, bytes + nb
  end
  if cur then out[#out + 1] = cur end
  return out
end

-- Muon groups of same-shape matrices in model order: {shape, numel, count}
local function muon_groups(m, cfg)
  local groups, byshape = {}, {}
  for _, q in ipairs(m.params) do
    if optimizer_of(cfg, q) == 'muon' then
      local key = table.concat(q.shape, 'x')
      if not byshape[key] then
        byshape[key] = { shape = q.shape, numel = q.numel, count = 0 }
        groups[#groups + 1] = byshape[key]
      end
      byshape[key].count = byshape[key].count + 1
    end
  end
  return groups
end

local function whole(m, cfg, sizes, r)
  local bf16 = cfg.dtype == 'bfloat16'
  for _, q in ipairs(m.params) do
    r.params = r.params + block(q.numel * sizes.p)
    r.optimizer = r.optimizer + (optimizer_of(cfg, q) == 'adamw' and 2 or 1) * block(q.numel * 4)
    if bf16 then r.master = r.master + block(q.numel * 4) end
  end
end

local POLICY = {}

function POLICY.none(m, cfg, n, sizes, r)
  whole(m, cfg, sizes, r)
  for _, q in ipairs(m.params) do r.grads = r.grads + block(q.numel * sizes.p) end
end

function POLICY.ddp(m, cfg, n, sizes, r)
  whole(m, cfg, sizes, r)
  local rev = {}
  for i = #m.params, 1, -1 do rev[#rev + 1] = m.params[i] end
  local bs = buckets(rev, cfg.bucket_mb * 2 ^ 20, sizes.p)
  for _, e in ipairs(bs) do r.grads = r.grads + block(e * sizes.p) end
  r.notes.grads = ('views of %d all-reduce buckets of <= %s MiB'):format(#bs, tostring(cfg.bucket_mb))
  r.notes.comm = 'none besides the buckets (the gradients are their views)'
end

local function zero(stage)
  return function(m, cfg, n, sizes, r)
    local sp, bf16 = sizes.p, cfg.dtype == 'bfloat16'
    local small, large = {}, {}
    for i = #m.params, 1, -1 do
      local q = m.params[i]
      if optimizer_of(cfg, q) == 'adamw' then
        if q.numel < MIN_SHARD then small[#small + 1] = q else large[#large + 1] = q end
      end
    end
    local cap = cfg.bucket_mb * 2 ^ 20
    local largest_send = 0
    -- replicated: the parameters stay, gradients are views of all-reduced buffers
    for _, q in ipairs(small) do
      r.params = r.params + block(q.numel * sp)
      r.optimizer = r.optimizer + 2 * block(q.numel * 4)
      if bf16 then r.master = r.master + block(q.numel * 4) end
    end
    for _, e in ipairs(buckets(small, cap, sp)) do r.grads = r.grads + block(e * sp) end
    -- a flat buffer padded to n*c elements of which this rank owns c
    local function flat(padded, c, state)
      r.params = r.params + block(padded * sp)
      if stage == 1 then  -- whole gradients (views), reduce-scattered into a shard
        r.grads = r.grads + block(padded * sp)
        r.comm = r.comm + block(c * sp)
      else                -- only the shard the reduce-scatters add into
        r.grads = r.grads + block(c * sp)
      end
      r.optimizer = r.optimizer + state
      largest_send = math.max(largest_send, block(padded * sp))
      -- the step's all-gather sends the rank's slice of the buffer it
      -- gathers into: the communicator stages a copy of the slice
      if n > 1 then r.step_extra = r.step_extra + block(c * sp) end
    end
    for _, e in ipairs(buckets(large, cap, sp)) do
      local c = ceil_div(e, n)
      flat(n * c, c, 2 * block(c * 4))
      if bf16 then r.master = r.master + block(c * 4) end
    end
    for _, g in ipairs(muon_groups(m, cfg)) do
      local per = ceil_div(g.count, n)
      flat(n * per * g.numel, per * g.numel, per * block(g.numel * 4))
      if bf16 then r.master = r.master + per * block(g.numel * 4) end
    end
    if stage == 1 then
      r.notes.grads = 'views of flat buffers (padded to a multiple of the ranks)'
      r.notes.comm = 'the gradient shards the reduce-scatters fill'
    else
      r.notes.grads = 'the reduce-scattered shards; tensors under 1024 elements whole'
      r.comm_fb = 2 * largest_send
      r.notes.comm = 'two packed gradient buckets in flight during backward'
    end
  end
end
POLICY.zero1, POLICY.zero2 = zero(1), zero(2)

-- FSDP: one flat buffer per unit, padded to a multiple of n; AdamW state on
-- the rank's slice of the unit, Muon on whole owned matrices.  Gathered:
-- the current unit and its prefetched neighbour (the head gathers the tied
-- embedding again); the unit's full gradients wait for their reduce-scatter.
function POLICY.fsdp(m, cfg, n, sizes, r)
  local sp, bf16 = sizes.p, cfg.dtype == 'bfloat16'
  local nunits = m.n_layer + 2
  local total, adam = {}, {}
  for i = 0, nunits - 1 do total[i], adam[i] = 0, 0 end
  for _, q in ipairs(m.params) do
    total[q.unit] = total[q.unit] + q.numel
    if optimizer_of(cfg, q) == 'adamw' then adam[q.unit] = adam[q.unit] + q.numel end
  end
  for i = 0, nunits - 1 do
    if total[i] > 0 then
      local sh = ceil_div(total[i], n)
      r.params = r.params + block(sh * sp)
      r.grads = r.grads + block(sh * sp)
      if bf16 then r.master = r.master + block(sh * 4) end
      if adam[i] > 0 then r.optimizer = r.optimizer + 2 * block(ceil_div(adam[i], n) * 4) end
    end
  end
  for _, g in ipairs(muon_groups(m, cfg)) do r.optimizer = r.optimizer + ceil_div(g.count, n) * block(g.numel * 4) end
  local eff = {}
  for i = 0, nunits - 1 do eff[i] = total[i] end
  if m.tied then eff[nunits - 1] = eff[nunits - 1] + m.params[1].numel end
  local pair, largest = 0, 0
  for i = 0, nunits - 1 do
    largest = math.max(largest, eff[i])
    if i + 1 < nunits then pair = math.max(pair, block(eff[i] * sp) + block(eff[i + 1] * sp)) end
  end
  r.gathered = pair
  r.comm_fb = block(largest * sp)
  r.notes.grads = 'shards of the flat units'
  r.notes.gathered = 'the largest unit and its prefetched neighbour'
  r.notes.comm = 'full gradients of the largest unit before its reduce-scatter'
end
POLICY.hsdp = POLICY.fsdp

-- per-rank bytes of the persistent components for policy `pol` sharded
-- over n ranks (the world; shard_size for hsdp)
local function persistent(m, cfg, pol, n, sizes)
  local r = { params = 0, grads = 0, optimizer = 0, master = 0, gathered = 0, comm = 0, comm_fb = 0, step_extra = 0,
              buffers = 0, notes = {} }
  for _, b in ipairs(m.buffers) do r.buffers = r.buffers + block(b.numel * sizes.p) end
  POLICY[pol](m, cfg, n, sizes, r)
  return r
end

-- Muon's optimizer-step temporaries (optim.Muon:step inside the trainer's
-- step scope): per matrix with r = min(rows, cols), c = max(rows, cols):
-- momentum direction r*c, scaled copy r*c, 5 Newton–Schulz iterations of
-- 3*r^2 + 2*r*c (fp32), transposed copies for tall matrices, the cast and
-- the scaled update in the parameter dtype.
local function optimizer_step_bytes(m, cfg, pol, n, sizes)
  local sharded = POLICY_RANK[pol] >= POLICY_RANK.zero1
  local total = 0
  for _, g in ipairs(muon_groups(m, cfg)) do
    local rows, cols = g.shape[1], g.shape[2]
    local r, c = math.min(rows, cols), math.max(rows, cols)
    local tall = rows > cols and 1 or 0
    local one = block(r * c * 4) * (2 + 2 * tall) + NS_STEPS * (3 * block(r * r * 4) + 2 * block(r * c * 4))
    if sizes.p ~= 4 then one = one + block(r * c * sizes.p) end
    one = one + block(r * c * sizes.p)
    total = total + (sharded and ceil_div(g.count, n) or g.count) * one
  end
  return total
end

-- ------------------------------------------------------------ config in --
local PLAN_OPTS = { world = true, device_memory = true, mem = true, margin = true }

-- device memory when none is given: the GPU's, or the machine's RAM
local function default_device_memory(cfg)
  if cfg.device ~= 'cpu' then
    local ok, cuda = pcall(require, 'gptlua.cuda')
    if ok and cuda.is_available() then
      local id = require('gptlua.tensor').device_id(cfg.device, 'plan: device')
      local props = cuda.get_device_properties(id)
      return props.total_memory, ('%s, %s'):format(cfg.device, props.name)
    end
    fail(('device %s is not available here to read its memory: pass --device_memory=SIZE (e.g. 80GiB)'):format(cfg.device))
  end
  local f = io.open('/proc/meminfo', 'r')
  if f then
    local text = f:read('*a')
    f:close()
    local kb = text:match('MemTotal:%s*(%d+)')
    if kb then return tonumber(kb) * 1024, 'cpu RAM, /proc/meminfo' end
  end
  fail('cannot read the machine memory from /proc/meminfo: pass --device_memory=SIZE')
end

-- vocabulary size when the recipe leaves it to the data
local function infer_vocab(cfg, hooks)
  if cfg.data == 'random' and not hooks.build_data then return 50304 end
  if cfg.data == 'char' and not hooks.build_data then
    local gl = require 'gptlua'
    local path = cfg.data_path
    local f = io.open(path, 'rb') or io.open(gl.root .. '/' .. path, 'rb')
    if not f then fail(('vocab_size is 0 and the char data %s is not there to count: pass --vocab_size=N'):format(path)) end
    local seen, n = {}, 0
    local text = f:read('*a')
    f:close()
    for i = 1, #text do
      local b = text:byte(i)
      if not seen[b] then seen[b] = true; n = n + 1 end
    end
    return n
  end
  fail('vocab_size is 0 and comes from the data at run time: pass --vocab_size=N')
end

-- Resolved config plus planner options from a recipe (table with hooks or
-- plain config) and --key=value strings.
local function resolve(recipe, args, opts)
  if type(recipe) ~= 'table' then fail('expected a recipe or config table, got ' .. type(recipe)) end
  opts = opts or {}
  local rargs = {}
  local popts = { world = opts.world, device_memory = opts.device_memory, margin = opts.margin }
  local device_arg
  for _, a in ipairs(args or {}) do
    local k, v = tostring(a):match('^%-%-([%w_%-]+)=(.*)$')
    k = k and k:gsub('%-', '_')
    local bare = tostring(a):match('^%-%-([%w_%-]+)$')
    if bare and (PLAN_OPTS[bare:gsub('%-', '_')] or bare == 'device') then
      fail(('--%s needs a value: --%s=VALUE'):format(bare, bare))
    end
    if k and PLAN_OPTS[k] then popts[k == 'mem' and 'device_memory' or k] = v
    elseif k == 'device' then device_arg = v
    else rargs[#rargs + 1] = a end
  end
  -- the device is only read for its memory: a GPU recipe can be planned
  -- on a machine without one
  local copy = {}
  for k, v in pairs(recipe) do copy[k] = v end
  local device = device_arg or copy.device or train.defaults.device
  copy.device = 'cpu'
  if type(device) ~= 'string' then fail('device must be a string, got ' .. type(device)) end
  local cfg, hooks = train.resolve_config(copy, rargs)
  if device == 'auto' then device = require('gptlua').default_device() end
  require('gptlua.tensor').device_id(device, 'config: device')
  cfg.device = device
  if hooks.build_model then fail('the recipe builds its own model (build_model); the planner knows gpt2 and nanochat') end
  if hooks.build_optimizer then fail('the recipe builds its own optimizer (build_optimizer); the planner knows adamw and nanochat') end
  if cfg.vocab_size == 0 then cfg.vocab_size = infer_vocab(cfg, hooks) end

  local world = popts.world == nil and 1 or tonumber(popts.world)
  if not world or world < 1 or world ~= math.floor(world) then
    fail(('world must be a positive integer, got %s'):format(tostring(popts.world)))
  end
  local valid = {}
  for _, p in ipairs(M.POLICIES) do valid[p] = true end
  if not valid[cfg.dist] then
    fail(("unknown dist '%s' (expected %s)"):format(tostring(cfg.dist), table.concat(M.POLICIES, ', ')))
  end
  local shard = world
  if cfg.dist == 'hsdp' then
    shard = cfg.shard_size
    if shard < 1 or shard ~= math.floor(shard) or world % shard ~= 0 then
      fail(('hsdp needs shard_size dividing the world size %d (ranks per shard group), got %s'):format(world,
        tostring(cfg.shard_size)))
    end
  end
  local margin = popts.margin == nil and M.DEFAULT_MARGIN or tonumber(popts.margin)
  if not margin or margin < 0 or margin >= 1 then
    fail(('margin must be a fraction in [0, 1), got %s'):format(tostring(popts.margin)))
  end
  local mem, mem_from
  if popts.device_memory ~= nil then
    mem, mem_from = M.parse_bytes(popts.device_memory, 'device_memory'), 'given'
  else
    mem, mem_from = default_device_memory(cfg)
  end
  local accum = cfg.gradient_accumulation_steps
  if cfg.total_batch_size > 0 then
    local per = cfg.batch_size * cfg.block_size * world
    if cfg.total_batch_size % per ~= 0 then
      fail(('total_batch_size %d is not a multiple of batch_size*block_size*world (%d)'):format(cfg.total_batch_size, per))
    end
    accum = cfg.total_batch_size / per
  end
  return cfg, { world = world, shard = shard, margin = margin, device_memory = mem, memory_from = mem_from,
                accum = accum, name = recipe.name or cfg.name }
end

-- ------------------------------------------------------------------ plan --
-- The numbers of one configuration (no suggestions, no text).
local function compute(cfg, o)
  local m = M.model_shapes(cfg)
  local sp = DTYPE_BYTES[cfg.dtype]
  local sizes = { a = sp, p = sp, f = cfg.dtype == 'float64' and 8 or 4, f64 = 8, i64 = 8 }
  local pol = cfg.dist
  local n = pol == 'hsdp' and o.shard or (pol == 'none' and 1 or o.world)
  local per = persistent(m, cfg, pol, n, sizes)
  -- weight-gradient temporaries of backward (the tied embedding: three)
  local ptemp = 0
  for _, q in ipairs(m.params) do ptemp = ptemp + block(q.numel * sp) end
  if m.tied then ptemp = ptemp + 2 * block(m.params[1].numel * sp) end
  local act = activations(m, cfg.batch_size, sizes, ptemp, cfg.activation_checkpointing)
  local other = activations(m, cfg.batch_size, sizes, ptemp, not cfg.activation_checkpointing)
  local step = optimizer_step_bytes(m, cfg, pol, n, sizes) + per.step_extra
  -- persistent state lives through the whole step; activations, gathered
  -- parameters and in-flight buckets only through forward and backward,
  -- Muon's temporaries only through the optimizer step
  local b = { params = per.params + per.buffers, grads = per.grads, optimizer = per.optimizer, master = per.master,
              gathered = per.gathered, comm = per.comm + per.comm_fb, act_forward = act.forward,
              act_backward = act.backward, activations = act.total, optimizer_step = step }
  b.persistent = b.params + b.grads + b.optimizer + b.master + per.comm
  b.forward_backward = act.total + per.gathered + per.comm_fb
  b.total = b.persistent + math.max(b.forward_backward, step)
  local with_ac = cfg.activation_checkpointing and act or other
  local without_ac = cfg.activation_checkpointing and other or act
  local step_notes = {}
  if step > per.step_extra then step_notes[#step_notes + 1] = 'Muon Newton-Schulz temporaries' end
  if per.step_extra > 0 then step_notes[#step_notes + 1] = 'all-gather staging copies of the shards' end
  per.notes.step = #step_notes > 0 and table.concat(step_notes, ' + ') or 'none (AdamW updates in place)'
  return { model = m, bytes = b, act = act, notes = per.notes, sizes = sizes, shard = n,
           activations = { without_checkpointing = without_ac.total, with_checkpointing = with_ac.total,
                           forward = act.forward, backward = act.backward, formula = act.formula,
                           layer_forward = act.layer_forward, layer_backward = act.layer_backward,
                           logits = act.logits, units = act.units },
           total_other_checkpointing = b.persistent + math.max(other.total + per.gathered + per.comm_fb, step) }
end

local function with(cfg, changes)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  for k, v in pairs(changes) do c[k] = v end
  return c
end

-- divisors of B below B, largest first (accumulation grows by B/b)
local function smaller_batches(B)
  local out = {}
  for b = B - 1, 1, -1 do if B % b == 0 then out[#out + 1] = b end end
  return out
end

-- What to change when the plan does not fit: a smaller micro-batch with
-- more accumulation (same tokens per step), activation checkpointing when
-- it saves memory, and each more sharded policy (with the micro-batch that
-- then fits); each with its resulting total.
local function suggestions(cfg, o, base, usable)
  local out = {}
  local function add(changes, r, why)
    local flags = {}
    local keys = {}
    for k in pairs(changes) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do flags[#flags + 1] = ('--%s=%s'):format(k, tostring(changes[k])) end
    out[#out + 1] = { changes = changes, total = r.bytes.total, fits = r.bytes.total <= usable,
                      flags = table.concat(flags, ' '), why = why, order = #out }
  end
  -- the largest micro-batch that fits under changes, or the smallest tried
  local function shrink(changes)
    local last
    for _, b in ipairs(smaller_batches(cfg.batch_size)) do
      local ch = with(changes, { batch_size = b })
      if cfg.total_batch_size == 0 then ch.gradient_accumulation_steps = o.accum * cfg.batch_size / b end
      local r = compute(with(cfg, ch), o)
      last = { ch, r }
      if r.bytes.total <= usable then return ch, r end
    end
    if last then return last[1], last[2] end
  end
  local accum_note = function(ch)
    local b = ch.batch_size
    return b and (' (accumulation %d, same tokens per step)'):format(o.accum * cfg.batch_size / b) or ''
  end
  local ch, r = shrink({})
  if ch then add(ch, r, 'smaller micro-batch' .. accum_note(ch)) end
  if not cfg.activation_checkpointing and base.total_other_checkpointing < base.bytes.total then
    local ac = { activation_checkpointing = true }
    local rac = compute(with(cfg, ac), o)
    if rac.bytes.total > usable then
      local ch2, r2 = shrink(ac)
      if ch2 then ac, rac = ch2, r2 end
    end
    add(ac, rac, 'activation checkpointing' .. accum_note(ac))
  end
  if o.world > 1 then
    for _, pol in ipairs({ 'ddp', 'zero1', 'zero2', 'fsdp' }) do
      if POLICY_RANK[pol] > POLICY_RANK[cfg.dist] then
        local pc = { dist = pol }
        local rp = compute(with(cfg, pc), o)
        if rp.bytes.total > usable then
          local ch3, r3 = shrink(pc)
          if ch3 then pc, rp = ch3, r3 end
        end
        add(pc, rp, ('%s over %d ranks'):format(pol, o.world) .. accum_note(pc))
      end
    end
  end
  -- the ones that fit first, each group in the order above
  table.sort(out, function(a, b)
    if a.fits ~= b.fits then return a.fits end
    return a.order < b.order
  end)
  return out
end

local function pad(s, n) return s .. string.rep(' ', math.max(0, n - #s)) end
local function lpad(s, n) return string.rep(' ', math.max(0, n - #s)) .. s end

local function render(r)
  local cfg, m, b, a = r.config, r.model, r.bytes, r.activations
  local lines = {}
  local function w(...) lines[#lines + 1] = table.concat({ ... }) end
  local sp = DTYPE_BYTES[cfg.dtype]
  w(('memory plan for %s: %s, %.2fM parameters (%d layers, %d heads%s, width %d, context %d, vocab %d)'):format(
    r.name, m.kind, m.num_params / 1e6, m.n_layer, m.n_head,
    m.n_kv_head ~= m.n_head and (', ' .. m.n_kv_head .. ' kv heads') or '', m.n_embd, m.block_size, m.vocab_size))
  local pol = cfg.dist
  local poltxt = pol == 'hsdp' and ('hsdp (shard groups of %d, %d replicas)'):format(r.shard, r.world / r.shard) or pol
  w(('policy %s on %d rank%s, %s, micro-batch %d x %d, accumulation %d, optimizer %s, activation checkpointing %s'):format(
    poltxt, r.world, r.world == 1 and '' or 's', cfg.dtype, cfg.batch_size, cfg.block_size, r.accum, cfg.optimizer,
    cfg.activation_checkpointing and 'on' or 'off'))
  if pol == 'none' and r.world > 1 then
    w(("note: dist = 'none' trains each of the %d ranks alone; --dist=ddp|zero1|zero2|fsdp|hsdp shares the work"):format(r.world))
  end
  w('')
  local P = m.num_params
  local function M_(x) return ('%.2fM'):format(x / 1e6) end
  local nmuon, nadam = 0, 0
  for _, q in ipairs(m.params) do
    if optimizer_of(cfg, q) == 'muon' then nmuon = nmuon + q.numel else nadam = nadam + q.numel end
  end
  local shard = (pol ~= 'none' and r.shard > 1) and (' / %d ranks'):format(r.shard) or ''
  local optdesc = nmuon > 0 and ('AdamW m+v fp32 on %s + Muon momentum fp32 on %s'):format(M_(nadam), M_(nmuon))
    or ('AdamW m+v fp32: %s x 8 B'):format(M_(P))
  local sharding = POLICY_RANK[pol]
  local function note(k) return r.notes[k] and ('; ' .. r.notes[k]) or '' end
  local rows = {
    { 'parameters', b.params, ('%s x %d B (%s)%s%s%s'):format(M_(P), sp, cfg.dtype, sharding >= POLICY_RANK.fsdp and shard or '',
      #m.buffers > 0 and ' + rotary tables' or '',
      (pol == 'zero1' or pol == 'zero2') and '; flat buffers padded to the ranks' or '') },
    { 'gradients', b.grads, ('%s x %d B%s%s'):format(M_(P), sp, sharding >= POLICY_RANK.zero2 and shard or '', note('grads')) },
    { 'optimizer state', b.optimizer, optdesc .. (sharding >= POLICY_RANK.zero1 and shard or '') },
    { 'master weights', b.master, cfg.dtype == 'bfloat16' and ('fp32 copy: %s x 4 B%s'):format(M_(P),
      sharding >= POLICY_RANK.zero1 and shard or '') or 'none (weights are ' .. cfg.dtype .. ')' },
    { 'gathered parameters', b.gathered, r.notes.gathered or 'none (parameters are whole on every rank)' },
    { 'communication buffers', b.comm, r.notes.comm or 'none' },
    { 'activations, forward', b.act_forward, 'every forward tensor of a micro-batch (formulas below)' },
    { 'activations, backward', b.act_backward, 'backward temporaries incl. one per weight gradient' },
    { 'optimizer step', b.optimizer_step, r.notes.step },
  }
  local width = 0
  for _, row in ipairs(rows) do width = math.max(width, #row[1]) end
  w(pad('  component', width + 2), '    per rank   how')
  for _, row in ipairs(rows) do w('  ', pad(row[1], width), lpad(fmt(row[2]), 12), '   ', row[3]) end
  w('  ', pad('total', width), lpad(fmt(b.total), 12), '   persistent ', fmt(b.persistent),
    ' + max(forward/backward ', fmt(b.forward_backward), ', optimizer step ', fmt(b.optimizer_step), ')')
  w('')
  local u = a.units
  w(('activations per micro-batch: B=%d T=%d C=%d H=%d%s V=%d; a=%d B (%s), f=%d B (statistics)'):format(
    u.B, u.T, u.C, u.H, u.Hk ~= u.H and (' Hkv=' .. u.Hk) or '', u.V, sp, cfg.dtype, r.sizes.f))
  w('  forward, per layer   ', a.formula.layer_forward, ' = ', fmt(a.layer_forward), (' x %d'):format(m.n_layer))
  w('  backward, per layer  ', a.formula.layer_backward, ' + weight grads = ', fmt(a.layer_backward), ' + weights')
  w('  outside the layers   forward ', a.formula.outside_forward)
  w('                       backward ', a.formula.outside_backward)
  w('  logits B*T*V*a       ', fmt(a.logits), ' (and as much again for their gradient)')
  w(('  without checkpointing %s, with %s%s'):format(fmt(a.without_checkpointing), fmt(a.with_checkpointing),
    a.with_checkpointing >= a.without_checkpointing
      and ' (more: the micro-step scope keeps the no-grad forward and the recomputation)' or ''))
  w('')
  local src = r.memory_from == 'given' and 'given' or r.memory_from
  w(('device memory %s (%s); usable %s with a %d%% margin'):format(fmt(r.device_memory), src, fmt(r.usable),
    math.floor(r.margin * 100 + 0.5)))
  if r.fits then
    w(('fits: %s of %s usable (%s to spare)'):format(fmt(b.total), fmt(r.usable), fmt(r.usable - b.total)))
  else
    w(('does NOT fit: needs %s, %s usable (%s over)'):format(fmt(b.total), fmt(r.usable), fmt(b.total - r.usable)))
    if #r.suggestions > 0 then
      w('suggestions:')
      for _, s in ipairs(r.suggestions) do
        w(('  %s: total %s, %s  [%s]'):format(s.flags, fmt(s.total), s.fits and 'fits' or 'does not fit', s.why))
      end
    end
  end
  return table.concat(lines, '\n') .. '\n'
end

-- plan(recipe_or_cfg, {world=1, device_memory=bytes|'80GiB', margin=0.1,
-- args={'--key=value', ...}}) -> the plan table (see the header); r.text is
-- what `gptlua --plan` prints.
function M.plan(recipe, opts)
  opts = opts or {}
  local cfg, o = resolve(recipe, opts.args, opts)
  local r = compute(cfg, o)
  r.config, r.name, r.world, r.accum = cfg, o.name, o.world, o.accum
  r.device_memory, r.memory_from, r.margin = o.device_memory, o.memory_from, o.margin
  r.usable = math.floor(o.device_memory * (1 - o.margin))
  r.fits = r.bytes.total <= r.usable
  r.suggestions = r.fits and {} or suggestions(cfg, o, r, r.usable)
  r.text = render(r)
  return r
end

-- `gptlua --plan recipe.lua [args]`: prints the plan; 0 when it was made
-- (whether or not it fits: the verdict is in the output).
function M.main(script, args)
  local f, err = loadfile(script)
  if not f then fail(('cannot load recipe %s: %s'):format(tostring(script), tostring(err))) end
  local recipe = f(unpack(args or {}))
  if type(recipe) ~= 'table' then
    fail(('recipe %s returned %s, expected a config table'):format(script, type(recipe)))
  end
  local r = M.plan(recipe, { args = args })
  io.write(r.text)
  io.stdout:flush()
  return 0
end

return M
