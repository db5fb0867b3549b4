-- gptlua.models.common — what the GPT variants share: config checking,
-- the LM head and loss, activation checkpointing per block, the fused MLP
-- and residual + norm, KV caches and sampling.
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local G = require 'gptlua.ffi'

local M = {}

-- copy of cfg with defaults filled in; unknown keys are rejected
function M.fill(cfg, defaults, what)
  local out = {}
  for k, v in pairs(defaults) do out[k] = v end
  for k, v in pairs(cfg or {}) do
    if defaults[k] == nil and k ~= 'vocab_size' then
      local keys = {}
      for d in pairs(defaults) do keys[#keys + 1] = d end
      table.sort(keys)
      error(('%s: unknown model option %s (valid: %s)'):format(what, tostring(k), table.concat(keys, ', ')), 3)
    end
    out[k] = v
  end
  return out
end

local function posint(cfg, k, what)
  local v = cfg[k]
  if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
    error(('%s: %s must be a positive integer, got %s'):format(what, k, tostring(v)), 4)
  end
end

function M.check_config(cfg, what)
  for _, k in ipairs({ 'vocab_size', 'block_size', 'n_layer', 'n_head', 'n_embd' }) do posint(cfg, k, what) end
  if cfg.n_embd % cfg.n_head ~= 0 then
    error(('%s: n_embd %d is not divisible by n_head %d'):format(what, cfg.n_embd, cfg.n_head), 3)
  end
  if cfg.n_kv_head then
    posint(cfg, 'n_kv_head', what)
    if cfg.n_head % cfg.n_kv_head ~= 0 then
      error(('%s: n_head %d is not divisible by n_kv_head %d'):format(what, cfg.n_head, cfg.n_kv_head), 3)
    end
  end
  if type(cfg.dropout) ~= 'number' or cfg.dropout < 0 or cfg.dropout >= 1 then
    error(('%s: dropout must be in [0, 1), got %s'):format(what, tostring(cfg.dropout)), 3)
  end
end

-- one block, recomputed in backward when activation checkpointing is on;
-- extra (a tensor or nil) is the block's third argument (nanochat's value
-- embedding), a checkpoint input of its own so its gradient flows
function M.run_block(block, x, cache, cfg, extra)
  if cfg.activation_checkpointing and block.training and cache == nil and gl.is_grad_enabled() then
    if extra ~= nil then return gl.checkpoint(function(h, e) return block(h, nil, e) end, x, extra) end
    return gl.checkpoint(function(h) return block(h) end, x)
  end
  return block(x, cache, extra)
end

-- logits = x W^T; with targets, the loss (mean cross-entropy, targets of -1
-- ignored, soft-capping fused into the loss).  Without targets the logits
-- are soft-capped.  With targets only the loss comes back (nil, loss): the
-- head, its soft-cap and the loss run fused over chunks of rows
-- (gl.linear_cross_entropy, ops_head.lua), never holding the (B, T, V)
-- logits; a `linear` other than gl.linear (a parallel layout's) keeps the
-- unfused head and returns the raw logits with the loss.
-- model.loss_reduction = 'none' (gptlua.eval, under gl.no_grad) makes the
-- loss each target's own, (B, T), 0 where ignored: the same fused head.
function M.head(model, x, targets, linear, weight, softcap)
  local reduction = model.loss_reduction
  if reduction == 'none' and targets ~= nil and (model.tp_head or linear ~= gl.linear) then
    error('per-token losses (loss_reduction = \'none\') need the model\'s own head, not a parallel layout\'s', 2)
  end
  -- a tensor-parallel model's vocabulary-parallel head (gptlua.dist.tensor_parallel)
  if model.tp_head then return model.tp_head(x, targets, weight, softcap) end
  if targets ~= nil and linear == gl.linear then
    return nil, gl.linear_cross_entropy(x, weight, targets, { ignore_index = -1, softcap = softcap, reduction = reduction })
  end
  local logits = linear(x, weight)
  if targets == nil then
    if softcap and softcap > 0 then logits = gl.softcap(logits, softcap) end
    return logits, nil
  end
  local loss = gl.cross_entropy(logits, targets, { ignore_index = -1, softcap = softcap })
  return logits, loss
end

-- KV caches for generation: one per layer, capacity S positions
-- Training FLOPs per token (forward + backward): 6 N for the weights, N
-- without the embedding that is only looked up (lookup_weight), plus the
-- attention scores and values, 12 * n_layer * n_embd * T (PaLM appendix B).
function M.flops_per_token(model, lookup_weight, T)
  local cfg = model.config
  local N = model:num_params() - lookup_weight:numel()
  return 6 * N + 12 * cfg.n_layer * cfg.n_embd * (T or cfg.block_size)
end

function M.new_caches(n_layer, B, Hkv, S, D, like)
  local caches = {}
  for i = 1, n_layer do
    caches[i] = { k = gl.zeros({ B, Hkv, S, D }, { dtype = like.dtype, device = like.device }),
                  v = gl.zeros({ B, Hkv, S, D }, { dtype = like.dtype, device = like.device }), pos = 0, cap = S }
  end
  return caches
end

-- appends this step's k, v (B, Hkv, T, D); returns the keys/values so far.
-- In a decode step replayed as a CUDA graph (gptlua.infer_graph) cache.slot
-- is a device tensor holding the position: k, v (T = 1) are added there
-- (the slot is still zero) and copied into the last slot, the current
-- token's, and the whole cache is returned (the attention's segment ids
-- mask what is not yet written)
function M.cache_append(cache, k, v)
  if cache.slot then
    local S = cache.cap
    k, v = k:contiguous(), v:contiguous()
    cache.k:narrow(3, S, 1):copy_(k)
    cache.v:narrow(3, S, 1):copy_(v)
    G.check(G.lib.gl_index_add(cache.k.c, 2, cache.slot.c, k.c), 2)
    G.check(G.lib.gl_index_add(cache.v.c, 2, cache.slot.c, v.c), 2)
    return cache.k, cache.v
  end
  local T = k.shape[3]
  if cache.pos + T > cache.cap then
    error(('generate: KV cache holds %d positions, %d needed'):format(cache.cap, cache.pos + T), 3)
  end
  cache.k:narrow(3, cache.pos + 1, T):copy_(k)
  cache.v:narrow(3, cache.pos + 1, T):copy_(v)
  cache.pos = cache.pos + T
  return cache.k:narrow(3, 1, cache.pos), cache.v:narrow(3, 1, cache.pos)
end

-- sample one id per row from logits rows (B, V) on the CPU
local function sample_rows(logits, temperature, top_k, u)
  local B, V = logits.shape[1], logits.shape[2]
  local rows = logits:to('cpu'):to('float64'):totable()
  local out = {}
  for b = 1, B do
    local row = rows[b]
    if temperature == 0 then
      local best = 1
      for i = 2, V do if row[i] > row[best] then best = i end end
      out[b] = best - 1
    else
      local order
      if top_k and top_k < V then
        order = {}
        for i = 1, V do order[i] = i end
        table.sort(order, function(a, c) return row[a] > row[c] or (row[a] == row[c] and a < c) end)
      end
      local keep = {}
      if order then for i = 1, top_k do keep[order[i]] = true end end
      local mx = -math.huge
      for i = 1, V do if (not order or keep[i]) and row[i] > mx then mx = row[i] end end
      local p, total = {}, 0
      for i = 1, V do
        local w = (not order or keep[i]) and math.exp((row[i] - mx) / temperature) or 0
        p[i] = w; total = total + w
      end
      local r, acc = u[b] * total, 0
      out[b] = V - 1
      for i = 1, V do
        acc = acc + p[i]
        if r < acc then out[b] = i - 1; break end
      end
    end
  end
  return out
end

-- model:generate(idx (B, T) int, n, {temperature=1, top_k=nil, seed=1337})
-- -> (B, T + n) int64.  Uses a KV cache while the context fits block_size,
-- then falls back to re-running the last block_size tokens.
function M.generate(model, idx, n, opts)
  opts = opts or {}
  local temperature = opts.temperature or 1.0
  local top_k, seed = opts.top_k, opts.seed or 1337
  if temperature < 0 then error('generate: temperature must be >= 0', 2) end
  local was_training = model.training
  model:eval()
  local cfg = model.config
  local B, T0 = idx.shape[1], idx.shape[2]
  local ids = {}
  local prompt = idx:to('cpu'):to('int64'):totable()
  for b = 1, B do ids[b] = {} for t = 1, T0 do ids[b][t] = prompt[b][t] end end
  local ok, err = pcall(gl.no_grad, function()
    local use_cache = T0 + n <= cfg.block_size
    local caches = use_cache and model:new_caches(B, T0 + n) or nil
    local feed = idx:to('int64')
    for step = 1, n do
      -- each step's temporaries are released when it ends (only the next
      -- input leaves the scope); the KV caches were made outside it
      feed = gl.scope(function()
        local ctx = feed
        if not use_cache and ctx.shape[2] > cfg.block_size then
          ctx = ctx:narrow(2, ctx.shape[2] - cfg.block_size + 1, cfg.block_size):contiguous()
        end
        local logits = model:forward(ctx, nil, caches)
        local last = logits:select(2, logits.shape[2])
        local u = gl.rand({ B }, { seed = seed, offset = (step - 1) * B, dtype = 'float64' }):tolist()
        local next_ids = sample_rows(last, temperature, top_k, u)
        for b = 1, B do ids[b][#ids[b] + 1] = next_ids[b] end
        local col = {}
        for b = 1, B do col[b] = { next_ids[b] } end
        local nt = gl.tensor(col, { dtype = 'int64', device = idx.device })
        return use_cache and nt or gl.cat({ feed, nt }, 2)
      end)
    end
  end)
  model:train(was_training)
  if not ok then error(err, 2) end
  return gl.tensor(ids, { dtype = 'int64', device = idx.device })
end


-- mlp(m, act): an MLP module's forward, m.c_proj(act(m.c_fc(x))), as the
-- fused gl.mlp when both layers are plain nn.Linear (a layout that replaced
-- or wrapped them runs its own modules instead)
-- (a layer the FP8 policy marked, l.fp8, runs its own forward)
local function plain_linear(l) return getmetatable(l) == nn.Linear and rawget(l, 'forward') == nil and not l.fp8 end
-- add_norm(x, r, norm): s = x + r and norm(s), the residual add fused with
-- the norm after it when norm is a plain nn.LayerNorm (gl.add_layer_norm)
-- or nn.RMSNorm (gl.add_rms_norm); returns s, norm(s)
function M.add_norm(x, r, norm)
  local mt = getmetatable(norm)
  if mt == nn.LayerNorm and rawget(norm, 'forward') == nil then
    return gl.add_layer_norm(x, r, norm.weight, norm.bias, norm.eps)
  elseif mt == nn.RMSNorm and rawget(norm, 'forward') == nil then
    return gl.add_rms_norm(x, r, norm.weight, norm.eps)
  end
  local s = x + r
  return s, norm(s)
end

-- linear(l, x, residual): residual + l(x), the add in the product
-- (gl.linear's residual) when l is a plain nn.Linear; a layout's replaced
-- or wrapped linear adds it after
function M.linear(l, x, residual)
  if residual == nil then return l(x) end
  if plain_linear(l) then return gl.linear(x, l.weight, l.bias, residual) end
  return residual + l(x)
end

-- residual (optional): residual + mlp(x), the add in the second product
-- when the MLP is fused (gl.mlp's residual)
function M.mlp(m, x, act, residual)
  local fc, proj = m.c_fc, m.c_proj
  if plain_linear(fc) and plain_linear(proj) then
    return gl.mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, act, residual)
  end
  local y = proj(gl[act](fc(x)))
  if residual then return residual + y end
  return y
end
return M
