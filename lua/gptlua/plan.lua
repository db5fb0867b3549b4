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
-- Activations: a dry run of the trainer's micro-step on symbolic tensors
-- (sizes and shared storages, no data).  The ops allocate and view as
-- lua/gptlua/ops*.lua do, the models call them as gptlua.models.* do, and
-- backward walks the graph as gptlua.autograd does with free_activations
-- (same order, same held counts), so the running total of live bytes is
-- the allocator's, tensor by tensor, and the peak is its maximum.  What it
-- shows for this engine:
--   - the forward keeps everything it makes until backward reaches it;
--   - the ops release their temporary views as soon as the kernel has
--     run (broadcasts, W^T, a linear's output view, attention's q/k/v
--     parts), so a view pins its storage only while its op needs it: the
--     views an op captures for its backward (a linear's input, attention's
--     output, the logits) go when that backward has run;
--   - backward releases, as it passes an op, its output, the norm
--     statistics and the attention/cross-entropy log-sum-exp, and each
--     gradient once consumed (a weight-gradient temporary once added into
--     .grad).  Only a broadcast's gradient stays to the end of the
--     micro-step (sum_to's reduction buffer: GPT-2's positions).
-- So the live set shrinks layer by layer through backward, and the peak
-- comes where backward starts: the whole forward plus the logits'
-- gradient and the head's input and weight gradients (the head's
-- backward), or, for a vocabulary small next to the width, inside the
-- last layer's backward.  With units BTC = B*T*C elements (B
-- micro-batch, T context, C width), BTK = B*T*C*Hkv/H, BT, BTH = B*T*H
-- (H heads), BTV = B*T*V (V vocab), CC = C*C (weights), a = bytes per
-- activation (the model dtype), f = bytes per statistic (fp32; fp64 for
-- float64 models):
--   gpt2 forward, per layer:     18*BTC*a + 4*BT*f + BTH*f   (+2*BTC*a with dropout)
--     ln_1, qkv (3), attention out, c_proj, residual + ln_2 (gl.add_layer_norm:
--     two), mlp (gl.mlp: GELU input (4), GELU (4), output), residual;
--     mean/rstd of both norms, attention lse
--   gpt2 backward, per layer:    18*BTC*a + 12*CC*a + 13*C*a (weight and bias gradients)
--   nanochat forward, per layer: 18*BTC*a + 4*BTK*a + 2*BTH*f + BTHk*f + 2*BT*f
--     norm, c_q, c_k/c_v (2 BTK), rope and norm of q, of k (2 BTK), attention
--     out, c_proj, residual + norm (gl.add_rms_norm: two), mlp (relu2 input
--     (4), relu2 (4), output), residual;
--     the norms' rstd, attention lse
--   nanochat backward, per layer: 22*BTC*a + 4*BTK*a + 12*CC*a
--   head: final norm BTC*a, logits BTV*a, CE losses/lse 2*BT*f, target mask
--     BT*8 (the mask and the losses go within the loss); dlogits BTV*a
-- Backward allocates a layer's gradients while the layer's forward is
-- still live and releases both by the time it leaves the layer.
-- `gptlua --plan` prints these formulas for the recipe, what of them
-- stays to the end of the micro-step, and where the peak comes.  For a big
-- vocabulary the logits and their gradient, 2*B*T*V*a, dominate.
--
-- Activation checkpointing (gl.checkpoint per block) runs each block
-- without recording inside a tensor scope, so only the block's output
-- stays (B*T*C*a per layer, plus the embedding output its backward views);
-- backward recomputes one block at a time and backpropagates through it
-- inside a scope that keeps only the input gradient.  The peak becomes
-- the layers' outputs + the larger of the head's backward and one layer's
-- forward and backward + the outside parts: less than without for two
-- layers or more; for one layer only when the logits and their gradient
-- outweigh what the recomputation adds.  The plan suggests it when it
-- saves memory.
--
-- Not counted: the dataset's token tensors (what the loaders hold) and
-- anything else outside the training step, so the total is an estimate and
-- a lower bound of the real peak, not an exact figure (`--plan` says so).
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
--   zero2     as zero1, but only the gradient shards persist: backward makes
--             each gradient afresh and the hook moves it into its bucket's
--             send buffer (two in flight on MPI ranks, one on one rank)
--   fsdp      one flat buffer per unit (embeddings, each block, head) padded
--             to N: each rank keeps ceil(unit/N) of the parameters and of
--             the gradients, AdamW state for its part, Muon momentum of the
--             whole matrices it owns (greedy owners; the plan takes the
--             busiest rank); for a bfloat16 model fp32 master shards, the
--             same ceil(unit/N) elements of each unit (the optimizer
--             updates them, the parameter shards are rounded from them).
--             Gathered units and full unit gradients come from the dry
--             run, which runs FSDP's units (sim_fsdp; cfg.fsdp's
--             options): blocks recomputed in backward, root units gathered
--             throughout, prefetch, reduce-scatters in flight (at worst
--             two, on MPI ranks)
--   hsdp      fsdp within groups of S ranks, replicated across N/S groups
--             (the replica all-reduce works in place)
-- The total is persistent state + the larger of forward/backward
-- (activations, gathered units, buckets in flight) and the optimizer step
-- (Muon's Newton–Schulz temporaries, all-gather staging, FSDP's Muon
-- exchange).  Where completion of a collective depends on other ranks the
-- plan takes the worst case, so on MPI ranks it is an upper bound.
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
-- A dry run of one micro-step on symbolic tensors: each has a size and a
-- storage shared with its views, nothing else.  The ops below allocate,
-- view and record exactly as lua/gptlua/ops*.lua do, and backward() is
-- gptlua.autograd's walk (same order, same held counts, same releases),
-- so the running total of live storage bytes is the allocator's, block by
-- block; spec/plan_spec.lua checks it against gl.memory_stats().
local function sz(k, unit, tag) return { k = k, unit = unit, tag = tag or 'a' } end

-- Storages are of a kind: 'act' (activations and gradients), 'gathered'
-- (FSDP's gathered parameters) or 'comm' (FSDP's full gradients waiting
-- for their reduce-scatter); the peak records what each kind held then.
local KINDS = { 'act', 'gathered', 'comm' }
local function new_sim(u, sizes)
  local S = { u = u, cur = 0, peak = 0, scopes = {}, grad = true, part = 0, phase = 'forward', allocs = {},
              live = { act = 0, gathered = 0, comm = 0 }, at_peak = { act = 0, gathered = 0, comm = 0 } }
  local function register(t)
    local s = S.scopes[#S.scopes]
    if s then s[#s + 1] = t end
    return t
  end
  -- a fresh storage holding sz, and the tensor that owns it
  function S.new(size, what, kind)
    kind = kind or 'act'
    local st = { bytes = block(size.k * u[size.unit] * sizes[size.tag]), refs = 1, sz = size, what = what,
                 part = S.part, phase = S.phase, kind = kind }
    S.cur = S.cur + st.bytes
    S.live[kind] = S.live[kind] + st.bytes
    if S.cur > S.peak then
      S.peak, S.peak_at = S.cur, S.where
      for _, k in ipairs(KINDS) do S.at_peak[k] = S.live[k] end
    end
    S.allocs[#S.allocs + 1] = st
    return register({ st = st, sz = size, live = true })
  end
  -- another tensor on t's storage
  function S.view(t)
    t.st.refs = t.st.refs + 1
    return register({ st = t.st, sz = t.sz, live = true })
  end
  -- gl_tensor_release: the storage goes with its last tensor
  function S.release(t)
    if not t.live then return end
    t.live = false
    local st = t.st
    st.refs = st.refs - 1
    if st.refs == 0 then
      S.cur = S.cur - st.bytes
      S.live[st.kind] = S.live[st.kind] - st.bytes
      st.freed = S.phase
    end
  end
  -- a parameter: its .grad exists and backward adds into it (unless a
  -- policy takes it away, see take_grad).  Its storage counts elsewhere
  -- (persistent state, or FSDP's gathered buffer it then shares).
  function S.leaf(size)
    return { st = { bytes = 0, refs = 1, kind = 'act' }, sz = size, live = true, requires_grad = true, grad = true }
  end
  -- zero2's hook: the gradient moves into the bucket's send buffer and goes
  function S.take_grad(x)
    x.grad = nil
    x.hook = function() if x.grad then S.release(x.grad); x.grad = nil end end
  end
  -- Tensor.scope: releases what fn made, except its result and kept tensors
  function S.scope(fn)
    local list = {}
    S.scopes[#S.scopes + 1] = list
    local res = fn()
    S.scopes[#S.scopes] = nil
    local outer = S.scopes[#S.scopes]
    for _, t in ipairs(list) do
      if t == res or t.keep then
        if outer and not t.keep then outer[#outer + 1] = t end
      else
        S.release(t)
        t.grad_fn = nil
      end
    end
    return res
  end
  function S.at(what) S.where = { part = S.part, what = what, phase = S.phase, recompute = S.recompute } end
  -- autograd.record
  function S.record(out, inputs, backward, what, owned)
    if not S.grad then return out end
    local needs = false
    for _, x in ipairs(inputs) do if x.requires_grad then needs = true end end
    if not needs then return out end
    out.requires_grad = true
    out.grad_fn = { inputs = inputs, backward = backward, what = what, owned = owned, part = S.part,
                    recompute = S.recompute }
    return out
  end
  local count_deps = require('gptlua.autograd').count_deps  -- the graph has autograd's shape
  -- autograd.backward (the trainer's and gl.checkpoint's with
  -- free_activations)
  function S.backward(root, grad, free_activations)
    local user = grad ~= nil
    if not user then grad = S.new(root.sz, 'loss gradient') end
    local prev = S.grad
    S.grad = false
    local held = {}
    local function hold(g) held[g] = (held[g] or 0) + 1 end
    local function drop(g)
      local n = held[g]
      if n == nil then return end
      if n <= 1 then held[g] = nil; S.release(g) else held[g] = n - 1 end
    end
    local deps = count_deps(root)
    local grads = { [root] = grad }
    hold(grad)
    if user then hold(grad) end
    local ready = { root }
    local function leaf_done(x)
      local g = grads[x]
      -- a parameter adds into its .grad; a checkpointed block's input (or a
      -- parameter whose .grad a policy took) gets a copy
      if g ~= nil and not x.grad then x.grad = S.new(g.sz, 'gradient copy'); x.grad.keep = true end
      if x.hook then x.hook(x) end  -- the gradient-ready hooks (policies)
      if g ~= nil then drop(g) end
      grads[x] = nil
    end
    while #ready > 0 do
      local t = table.remove(ready)
      local fn = t.grad_fn
      if fn == nil then
        leaf_done(t)
      else
        local g = grads[t]
        grads[t] = nil
        S.part, S.where = fn.part, { part = fn.part, what = fn.what, phase = 'backward', recompute = fn.recompute }
        -- a node with adds_into takes over its input's gradient so far
        -- (autograd's adds_into: gl.add_layer_norm's norm) and lets it go
        local taken
        if fn.adds_into and g ~= nil then
          local xj = fn.inputs[fn.adds_into]
          taken = grads[xj]
          grads[xj] = nil
        end
        local in_grads = g ~= nil and { fn.backward(g) } or {}
        if taken ~= nil then drop(taken) end
        for j, x in ipairs(fn.inputs) do
          if x.requires_grad then
            local gx = in_grads[j]
            if gx ~= nil then
              local acc = grads[x]
              if acc == nil then
                grads[x] = gx; hold(gx)
              else
                local sum = S.new(acc.sz, 'gradient sum')
                grads[x] = sum; hold(sum)
                drop(acc)
                if held[gx] == nil and gx ~= g then S.release(gx) end
              end
            end
            deps[x] = deps[x] - 1
            if deps[x] == 0 then
              if x.grad_fn == nil then leaf_done(x) else ready[#ready + 1] = x end
            end
          end
        end
        if g ~= nil then drop(g) end
        if fn.owned then for _, o in ipairs(fn.owned) do S.release(o) end end
        fn.inputs, fn.owned = nil, nil
        if free_activations and t ~= root then S.release(t) end
      end
    end
    S.grad = prev
  end
  return S
end

-- The ops' memory behaviour (lua/gptlua/ops*.lua).  Besides the
-- allocations, what matters is which storages a view pins.  The ops drop
-- their temporary views as soon as the kernel has run (broadcast views,
-- W^T, a linear's output view, attention's q/k/v parts, the reduction's
-- keepdim buffer), so those pin nothing; a view an op captures for its
-- backward (a linear's x2, attention's (B,H,T,D) output view,
-- cross-entropy's logits view) pins its base until that backward has run
-- (unless the graph is retained, which the trainer never does).  A
-- recorded view (.view/.transpose of nanochat's q, k, v, y) is an op
-- output like any other: free_activations releases it once its node has
-- run.  What a view pins to the end of the micro-step: a broadcast
-- operand's gradient (sum_to's reduction buffer behind a view: GPT-2's
-- positions).
local function sim_ops(S)
  local O = {}
  local function unary(x, what)
    S.at(what)
    local out = S.new(x.sz, what)
    return S.record(out, { x }, function() return S.new(x.sz, what .. ' dx') end, what)
  end
  O.unary, O.dropout, O.rope = unary, unary, unary
  -- view, reshape of a contiguous tensor, transpose: a view both ways
  function O.view(x, what)
    return S.record(S.view(x), { x }, function(g) return S.view(g) end, what)
  end
  -- x2 (x as a matrix) stays for the backward's weight gradient; dx and
  -- the bias gradient are views of raw products that hold their storage
  -- alone
  function O.linear(x, W, b, osize, what)
    S.at(what)
    local x2 = S.view(x)
    local out = S.new(osize, what)
    return S.record(out, b and { x, W, b } or { x, W }, function()
      local gx, gW, gb
      if x.requires_grad then gx = S.new(x.sz, what .. ' dx') end
      if W.requires_grad then gW = S.new(W.sz, what .. ' weight gradient') end
      if b and b.requires_grad then gb = S.new(b.sz, what .. ' bias gradient') end
      S.release(x2)
      return gx, gW, gb
    end, what)
  end
  -- layer_norm (mean and rstd) and rms_norm (rstd): the statistics are
  -- owned by the node, released once its backward has run
  local function norm(x, w, b, stat, what, with_mean)
    S.at(what)
    local y = S.new(x.sz, what)
    local owned = {}
    if with_mean then owned[1] = S.new(sz(1, stat, 'f'), what .. ' mean') end
    owned[#owned + 1] = S.new(sz(1, stat, 'f'), what .. ' rstd')
    local inputs = { x }
    if w then inputs[#inputs + 1] = w end
    if b then inputs[#inputs + 1] = b end
    return S.record(y, inputs, function()
      local dx = S.new(x.sz, what .. ' dx')
      local dw = w and S.new(w.sz, what .. ' weight gradient')
      local db = b and S.new(b.sz, what .. ' bias gradient')
      if dw then return dx, dw, db end
      return dx, db
    end, what, owned)
  end
  function O.layer_norm(x, w, b, what) return norm(x, w, b, 'BT', what, true) end
  -- gl.add_layer_norm / gl.add_rms_norm: s and y, then the statistics; s is
  -- an add node, y a norm node that takes over the gradient s has so far
  -- (adds_into) and returns dx with it added, no gradient sum of its own
  function O.add_norm(x, r, w, b, stat, what, with_mean)
    S.at(what)
    local s = S.new(x.sz, what .. ' sum')
    local y = S.new(x.sz, what)
    local owned = {}
    if with_mean then owned[1] = S.new(sz(1, stat, 'f'), what .. ' mean') end
    owned[#owned + 1] = S.new(sz(1, stat, 'f'), what .. ' rstd')
    s = S.record(s, { x, r }, function(g) return g, g end, what .. ' sum')
    local inputs = { s }
    if w then inputs[#inputs + 1] = w end
    if b then inputs[#inputs + 1] = b end
    y = S.record(y, inputs, function()
      local dx = S.new(x.sz, what .. ' dx')
      local dw = w and S.new(w.sz, what .. ' weight gradient')
      local db = b and S.new(b.sz, what .. ' bias gradient')
      if dw then return dx, dw, db end
      return dx, db
    end, what, owned)
    if y.grad_fn then y.grad_fn.adds_into = 1 end
    return s, y
  end
  -- gl.mlp: the activation's input and output belong to the node (released
  -- after its backward, or at once without autograd); backward makes the
  -- weight and bias gradients, then d(activation input), then dx, and lets
  -- d(activation input) go
  function O.mlp(x, W1, b1, W2, b2, hsize, what)
    S.at(what)
    local x2 = S.view(x)
    local pre = S.new(hsize, what .. ' activation input')
    local h = S.new(hsize, what .. ' activation')
    local out = S.new(x.sz, what)
    local params = { W1, b1 or false, W2, b2 or false }
    local inputs = { x }
    for _, t in ipairs(params) do if t then inputs[#inputs + 1] = t end end
    out = S.record(out, inputs, function()
      local grads = { false }
      for _, t in ipairs(params) do
        if t then grads[#grads + 1] = t.requires_grad and S.new(t.sz, what .. ' parameter gradient') or false end
      end
      local dpre = S.new(hsize, what .. ' activation input gradient')
      if x.requires_grad then grads[1] = S.new(x.sz, what .. ' dx') end
      S.release(dpre)
      S.release(x2)
      for i = 1, #grads do if grads[i] == false then grads[i] = nil end end
      return unpack(grads, 1, #inputs)
    end, what, { pre, h })
    if not out.grad_fn then S.release(pre); S.release(h); S.release(x2) end
    return out
  end
  function O.rms_norm(x, stat, what) return norm(x, nil, nil, stat, what, false) end
  -- a + b, b broadcast over the batch when smaller (GPT-2's positions):
  -- b's gradient is sum_to's reduction, reached through a view that
  -- leaves the reduction buffer in the micro-step's scope
  function O.add(a, b, what)
    S.at(what)
    local out = S.new(a.sz, what)
    local bcast = b.sz.unit ~= a.sz.unit
    return S.record(out, { a, b }, function(g)
      return g, bcast and S.view(S.new(b.sz, what .. ' broadcast gradient')) or g
    end, what)
  end
  function O.embedding(W, osize, what)
    S.at(what)
    local out = S.new(osize, what)
    return S.record(out, { W }, function() return S.new(W.sz, what .. ' gradient') end, what)
  end
  -- GPT-2's fused attention on the c_attn output: the backward reads the
  -- output through its (B,H,T,D) view, and writes dq, dk, dv into one dqkv
  function O.attention_qkv(qkv, stat, what)
    S.at(what)
    local y = S.new(sz(qkv.sz.k / 3, qkv.sz.unit, qkv.sz.tag), what)
    local yv = S.view(y)
    local lse = S.new(sz(1, stat, 'f'), what .. ' lse')
    return S.record(y, { qkv }, function()
      local dqkv = S.new(qkv.sz, what .. ' dqkv')
      S.release(yv)
      return dqkv
    end, what, { lse })
  end
  -- scaled_dot_product_attention: output and input gradients are (B,H,T,D)
  -- views that alone hold their (B,T,H,D) buffers
  function O.sdpa(q, k, v, stat, what)
    S.at(what)
    local out = S.new(q.sz, what)
    local lse = S.new(sz(1, stat, 'f'), what .. ' lse')
    return S.record(out, { q, k, v }, function()
      return S.new(q.sz, what .. ' dq'), S.new(k.sz, what .. ' dk'), S.new(v.sz, what .. ' dv')
    end, what, { lse })
  end
  -- cross-entropy with ignore_index: per-row losses (summed, then gone),
  -- the count of targets kept (a float64 mask, gone once counted), the
  -- loss; the logits view stays for the backward, whose dlogits is a view
  -- holding its storage alone
  function O.cross_entropy(logits, what)
    S.at(what)
    local l2 = S.view(logits)
    local losses = S.new(sz(1, 'BT', 'f'), what .. ' losses')
    local lse = S.new(sz(1, 'BT', 'f'), what .. ' lse')
    local ig = S.new(sz(1, '1', 'i64'), 'ignore_index scalar')
    local mask = S.new(sz(1, 'BT', 'f64'), 'target mask')
    local count = S.new(sz(1, '1', 'f64'), 'target count')
    S.release(ig); S.release(mask); S.release(count)
    local total = S.new(sz(1, '1', 'f'), 'loss sum')
    local loss = S.new(total.sz, 'loss')
    S.release(total); S.release(losses)
    return S.record(loss, { logits }, function()
      local dl = S.new(logits.sz, 'dlogits')
      S.release(l2)
      return dl
    end, what, { lse })
  end
  -- gl.checkpoint: the block runs without recording inside a scope (only
  -- its output stays, pinned by the detached view that is recorded); its
  -- backward views the input (pinned to the end of the micro-step), reruns
  -- the block and backpropagates inside a scope that keeps only the input
  -- gradient (a fresh copy)
  function O.checkpoint(fn, x)
    local out = S.scope(function()
      S.grad = false
      local r = fn(x)
      S.grad = true
      return r
    end)
    local o = S.view(out)
    return S.record(o, { x }, function(g)
      local d = S.view(x)
      d.requires_grad = true
      S.grad, S.recompute = true, true
      local dg = S.scope(function()
        local out2 = fn(d)
        S.backward(out2, g, true)
        return d.grad
      end)
      S.grad, S.recompute = false, false
      return dg
    end, 'block')
  end
  return O
end

-- gptlua.dist.fsdp on the simulated tensors.  Units: each block, the
-- embeddings and the head (what is left: ln_f or lm_head).  Root units
-- (the embeddings, the head) are gathered, with their full gradient
-- buffer, from the model's forward until their gradients are final.  A
-- block that reshards after forward (the default) is gathered for its
-- forward, which runs without recording; backward re-gathers it, recomputes
-- and backpropagates through it inside a scope (without free_activations).
-- Otherwise blocks behave like root units.  The next block's gather is
-- started before a block runs (prefetch; the previous one in backward).
-- A unit's full gradient goes to a reduce-scatter (cast to the reduce
-- dtype first when it differs) and stays until that completes: in a
-- one-rank world at once; on MPI ranks it depends on the others, and the
-- plan takes the worst case, where only the bound of two in flight makes
-- the policy wait.  accumulate = 'unsharded' keeps every unit gathered with
-- its full gradient across micro-steps; the plan is of the last micro-step,
-- which starts with all of them.  o: n (ranks per shard group), accum,
-- local_comm, and cfg.fsdp's options.
local MAX_IN_FLIGHT = 2           -- gptlua.dist.fsdp.MAX_IN_FLIGHT
local function sim_fsdp(S, m, params, sizes, o)
  local F = { phase = 'forward', wrap = {}, roots = {}, pending = {} }
  local L, n = m.n_layer, o.n
  local unsharded = o.accumulate == 'unsharded'
  local cast = o.reduce_dtype ~= o.dtype
  local rtag = o.reduce_dtype == 'bfloat16' and 'bf16' or 'f32'
  local units = {}
  for i = 0, L + 1 do
    units[i] = { index = i, params = {}, numel = 0, state = 'sharded', root = i == 0 or i == L + 1,
                 received = o.accum > 1 and not unsharded,
                 name = i == 0 and 'embeddings' or i == L + 1 and 'head' or ('block %d'):format(i) }
  end
  for _, q in ipairs(m.params) do
    local u = units[q.unit]
    u.numel = u.numel + q.numel
    u.params[#u.params + 1] = params[q.name]
  end
  for i = 0, L + 1 do
    local u = units[i]
    local c = math.ceil(u.numel / n)
    u.full_size, u.shard_size = sz(1, 'unit' .. i), sz(1, 'shard' .. i, cast and rtag or 'a')
    S.u['unit' .. i], S.u['shard' .. i] = n * c, c
    if not u.root then F.wrap[#F.wrap + 1] = u elseif u.numel > 0 then F.roots[#F.roots + 1] = u end
  end

  local function start_gather(u)
    u.full = S.new(u.full_size, 'gathered ' .. u.name, 'gathered')
    for _, p in ipairs(u.params) do   -- the parameters become views of it
      p.st, p.live = u.full.st, true
      u.full.st.refs = u.full.st.refs + 1
    end
    u.state = 'gathered'
  end
  local function release(u)
    if u.state ~= 'gathered' then return end
    for _, p in ipairs(u.params) do S.release(p) end
    S.release(u.full)
    u.full, u.state = nil, 'sharded'
  end
  local function acquire(u)
    if u.state == 'sharded' then start_gather(u) end
    local v = o.prefetch and not u.root and F.wrap[u.index + (F.phase == 'forward' and 1 or -1)]
    if v and v.state == 'sharded' then start_gather(v) end
  end
  local function grad_buffer(u)
    if not u.gfull then u.gfull = S.new(u.full_size, 'full gradient of ' .. u.name, 'comm') end
  end
  local function complete(e)
    if e.recv then S.release(e.recv) end
    S.release(e.send)
  end
  local function poll()
    if o.local_comm then while F.pending[1] do complete(table.remove(F.pending, 1)) end end
  end
  local function finalize(u)
    if not u.gfull then return end
    u.expecting = false
    local send = u.gfull
    u.gfull = nil
    if cast then
      local c = S.new(sz(1, 'unit' .. u.index, rtag), 'gradient of ' .. u.name .. ' in ' .. o.reduce_dtype, 'comm')
      S.release(send)
      send = c
    end
    local recv = (u.received or cast) and S.new(u.shard_size, 'received shard of ' .. u.name, 'comm') or nil
    u.received = true
    F.pending[#F.pending + 1] = { send = send, recv = recv }
    release(u)
    poll()
    while #F.pending > MAX_IN_FLIGHT do complete(table.remove(F.pending, 1)) end
  end
  local function hook(p)
    local u = p.unit
    if u.expecting and not u.seen[p] then
      u.seen[p] = true
      u.ready = u.ready + 1
      if u.ready == #u.params then finalize(u) end
    end
    poll()
  end
  for i = 0, L + 1 do for _, p in ipairs(units[i].params) do p.unit, p.hook = units[i], hook end end
  local function expect_hooks(u)
    grad_buffer(u)
    if not u.expecting then u.expecting, u.ready, u.seen = true, 0, {} end
  end

  -- the model's forward starts: root units gathered, the first block
  -- prefetched (an unsharded accumulation: everything from the micro-steps
  -- before)
  function F.start()
    if unsharded and o.accum > 1 then
      for i = 0, L + 1 do
        if units[i].numel > 0 then start_gather(units[i]); grad_buffer(units[i]) end
      end
    end
    for _, u in ipairs(F.roots) do if u.state == 'sharded' then start_gather(u) end end
    if o.prefetch and F.wrap[1] and F.wrap[1].state == 'sharded' then start_gather(F.wrap[1]) end
    for _, u in ipairs(F.roots) do expect_hooks(u) end
  end
  function F.forward_done() F.phase = 'backward' end

  local function keep_after_forward(u)
    return F.phase == 'forward' and (not o.reshard or u == F.wrap[#F.wrap] or unsharded)
  end
  -- block i called on x; fn runs the block
  function F.call(i, fn, x)
    local u = units[i]
    if not S.grad then   -- without recording (the model's checkpoint)
      acquire(u)
      local r = S.scope(function() return fn(x) end)
      if not keep_after_forward(u) then release(u) end
      poll()
      return r
    end
    if F.phase ~= 'forward' or not o.reshard then  -- kept gathered until its gradients are final
      acquire(u)
      expect_hooks(u)
      return fn(x)
    end
    acquire(u)
    local out = S.scope(function()
      S.grad = false
      local r = fn(x)
      S.grad = true
      return r
    end)
    if not keep_after_forward(u) then release(u) end
    poll()
    local inputs = { x }
    for _, p in ipairs(u.params) do inputs[#inputs + 1] = p end
    return S.record(S.view(out), inputs, function(g)
      acquire(u)
      grad_buffer(u)
      local dg = S.scope(function()
        local d = S.view(x)
        d.requires_grad = true
        S.grad, S.recompute = true, true
        S.backward(fn(d), g, false)
        S.grad, S.recompute = false, false
        return d.grad
      end)
      finalize(u)
      return dg
    end, 'block')
  end
  return F
end

-- The models' forward (gptlua.models.*) on the simulated ops; P(name) is
-- the parameter of that name (nil for a missing bias).
local FORWARD = {}

function FORWARD.gpt2(O, S, m, P, checkpointing)
  local L, drop = m.n_layer, m.dropout > 0
  local BTC = sz(1, 'BTC')
  local function dropout(x, what) if drop then return O.dropout(x, what) end return x end
  S.part = 0
  S.at('positions')
  S.new(sz(1, 'T', 'i64'), 'positions')
  local tok = O.embedding(P('transformer.wte.weight'), BTC, 'wte lookup')
  local pos = O.embedding(P('transformer.wpe.weight'), sz(1, 'TC'), 'wpe lookup')
  local x = dropout(O.add(tok, pos, 'embedding sum'), 'embedding dropout')
  for i = 1, L do
    S.part = i
    local h = 'transformer.h.' .. (i - 1) .. '.'
    local function block(xi)
      local a = O.layer_norm(xi, P(h .. 'ln_1.weight'), P(h .. 'ln_1.bias'), 'ln_1')
      a = O.linear(a, P(h .. 'attn.c_attn.weight'), P(h .. 'attn.c_attn.bias'), sz(3, 'BTC'), 'c_attn')
      a = O.attention_qkv(a, 'BTH', 'attention')
      a = dropout(O.linear(a, P(h .. 'attn.c_proj.weight'), P(h .. 'attn.c_proj.bias'), BTC, 'attn c_proj'),
        'attn dropout')
      local f
      xi, f = O.add_norm(xi, a, P(h .. 'ln_2.weight'), P(h .. 'ln_2.bias'), 'BT', 'residual + ln_2', true)
      f = O.mlp(f, P(h .. 'mlp.c_fc.weight'), P(h .. 'mlp.c_fc.bias'), P(h .. 'mlp.c_proj.weight'),
        P(h .. 'mlp.c_proj.bias'), sz(4, 'BTC'), 'mlp')
      f = dropout(f, 'mlp dropout')
      return O.add(xi, f, 'residual')
    end
    local function call(xi) return S.call_block(i, block, xi) end
    if checkpointing then x = O.checkpoint(call, x) else x = call(x) end
  end
  S.part = L + 1
  x = O.layer_norm(x, P('transformer.ln_f.weight'), P('transformer.ln_f.bias'), 'ln_f')
  return O.linear(x, P('transformer.wte.weight'), nil, sz(1, 'BTV'), 'lm head (tied)')
end

function FORWARD.nanochat(O, S, m, P, checkpointing)
  local L = m.n_layer
  local BTC, BTK = sz(1, 'BTC'), sz(1, 'BTK')
  S.part = 0
  local x = O.rms_norm(O.embedding(P('transformer.wte.weight'), BTC, 'wte lookup'), 'BT', 'embedding norm')
  for i = 1, L do
    S.part = i
    local h = 'transformer.h.' .. (i - 1) .. '.'
    local function block(xi)
      local a = O.rms_norm(xi, 'BT', 'attn norm')
      local q = O.view(O.linear(a, P(h .. 'attn.c_q.weight'), nil, BTC, 'c_q'), 'q view')
      local k = O.view(O.linear(a, P(h .. 'attn.c_k.weight'), nil, BTK, 'c_k'), 'k view')
      local v = O.view(O.linear(a, P(h .. 'attn.c_v.weight'), nil, BTK, 'c_v'), 'v view')
      q = O.rms_norm(O.rope(q, 'rope q'), 'BTH', 'norm q')
      k = O.rms_norm(O.rope(k, 'rope k'), 'BTHk', 'norm k')
      q, k, v = O.view(q, 'q transpose'), O.view(k, 'k transpose'), O.view(v, 'v transpose')
      local y = O.view(O.view(O.sdpa(q, k, v, 'BTH', 'attention'), 'y transpose'), 'y reshape')
      local f
      xi, f = O.add_norm(xi, O.linear(y, P(h .. 'attn.c_proj.weight'), nil, BTC, 'attn c_proj'), nil, nil, 'BT',
        'residual + mlp norm', false)
      f = O.mlp(f, P(h .. 'mlp.c_fc.weight'), nil, P(h .. 'mlp.c_proj.weight'), nil, sz(4, 'BTC'), 'mlp')
      return O.add(xi, f, 'residual')
    end
    local function call(xi) return S.call_block(i, block, xi) end
    if checkpointing then x = O.checkpoint(call, x) else x = call(x) end
  end
  S.part = L + 1
  x = O.rms_norm(x, 'BT', 'final norm')
  return O.linear(x, P('lm_head.weight'), nil, sz(1, 'BTV'), 'lm head')
end

local function units(d)
  return { BTC = d.B * d.T * d.C, BTK = d.B * d.T * d.Ck, BT = d.B * d.T, BTH = d.B * d.T * d.H,
           BTHk = d.B * d.T * d.Hk, BTV = d.B * d.T * d.V, TC = d.T * d.C, T = d.T, ['1'] = 1,
           C = d.C, CC = d.C * d.C, CkC = d.Ck * d.C, VC = d.V * d.C }
end

-- a parameter's size in the formula units (bytes are exact either way)
local function param_size(m, u, q)
  local C, Ck, unit = m.n_embd, m.n_embd * m.n_kv_head / m.n_head, 'CC'
  if q.name:match('wte%.weight$') or q.name:match('^lm_head') then unit = 'VC'
  elseif q.name:match('wpe%.weight$') then unit = 'TC'
  elseif #q.shape == 1 then unit = 'C'
  elseif (q.name:match('c_k%.weight$') or q.name:match('c_v%.weight$')) and Ck ~= C then unit = 'CkC' end
  local k = q.numel / u[unit]
  if k ~= math.floor(k) then return sz(q.numel, '1') end
  return sz(k, unit)
end

-- "18*BTC*a + BTH*f + 4*BT*f" for a list of storages
local TAG_BYTES = { a = 'a', f = 'f', f64 = '8', i64 = '8' }
local UNIT_ORDER = { 'BTV', 'BTC', 'BTK', 'TC', 'BTH', 'BTHk', 'BT', 'T', 'VC', 'CC', 'CkC', 'C', '1' }
local UNIT_RANK = {}
for i, name in ipairs(UNIT_ORDER) do UNIT_RANK[name] = i end
local function formula(list)
  local acc, keys = {}, {}
  for _, st in ipairs(list) do
    local key = st.sz.unit == '1' and '1' or (st.sz.unit .. '*' .. st.sz.tag)
    if not acc[key] then acc[key] = { n = 0, unit = st.sz.unit, tag = st.sz.tag }; keys[#keys + 1] = key end
    acc[key].n = acc[key].n + st.sz.k
  end
  table.sort(keys, function(a, b)
    local ra, rb = UNIT_RANK[acc[a].unit], UNIT_RANK[acc[b].unit]
    if ra ~= rb then return ra < rb end
    return a < b
  end)
  local parts = {}
  for _, key in ipairs(keys) do
    local e = acc[key]
    if e.unit == '1' then parts[#parts + 1] = e.n .. (e.n == 1 and ' scalar' or ' scalars')
    else parts[#parts + 1] = (e.n == 1 and '' or (e.n .. '*')) .. e.unit .. '*' .. TAG_BYTES[e.tag] end
  end
  return #parts > 0 and table.concat(parts, ' + ') or 'nothing'
end
local function sum_bytes(list)
  local n = 0
  for _, st in ipairs(list) do n = n + st.bytes end
  return n
end
local function filter(list, pred)
  local out = {}
  for _, st in ipairs(list) do if pred(st) then out[#out + 1] = st end end
  return out
end
local function concat(...)
  local out = {}
  for _, list in ipairs({ ... }) do for _, x in ipairs(list) do out[#out + 1] = x end end
  return out
end

-- Activation bytes of one micro-step of the trainer (forward, the loss
-- scaled by 1/accumulation, backward with free_activations, inside one
-- tensor scope) for model m at micro-batch B: the bytes live at the end
-- of the forward, the peak over the micro-step, and where it comes.
-- pol: nil, {taken = predicate} (zero2's parameters whose gradients it
-- takes) or {fsdp = options of sim_fsdp}.
local function activations(m, B, sizes, checkpointing, pol)
  local d = { B = B, T = m.block_size, C = m.n_embd, H = m.n_head, Hk = m.n_kv_head, V = m.vocab_size,
              Ck = m.n_embd * m.n_kv_head / m.n_head }
  local u = units(d)
  local S = new_sim(u, sizes)
  local O = sim_ops(S)
  local params = {}
  for _, q in ipairs(m.params) do
    params[q.name] = S.leaf(param_size(m, u, q))
    if pol and pol.taken and pol.taken(q) then S.take_grad(params[q.name]) end
  end
  local function P(name) return params[name] end
  local F = pol and pol.fsdp and sim_fsdp(S, m, params, sizes, pol.fsdp)
  S.call_block = F and F.call or function(_, fn, x) return fn(x) end
  local forward
  S.scope(function()
    if F then F.start() end
    local loss = O.cross_entropy(FORWARD[m.kind](O, S, m, P, checkpointing), 'cross-entropy')
    if F then F.forward_done() end
    local scaled = O.unary(loss, 'loss / accumulation')
    forward = S.live.act
    S.phase = 'backward'
    S.backward(scaled, nil, true)
    S.phase = 'end'
  end)
  -- what one layer allocates and what of it stays to the end of the micro-step
  -- (a middle layer: the first and last differ only in where gradients come from)
  local L = m.n_layer
  local mid = math.max(1, math.floor((L + 1) / 2))
  local acts = filter(S.allocs, function(st) return st.kind == 'act' end)
  local function part(p, phase) return filter(acts, function(st) return st.part == p and st.phase == phase end) end
  local lf, lb = part(mid, 'forward'), part(mid, 'backward')
  local outside_f = filter(acts, function(st) return (st.part == 0 or st.part == L + 1) and st.phase == 'forward' end)
  local outside_b = filter(acts, function(st) return (st.part == 0 or st.part == L + 1) and st.phase == 'backward' end)
  local function stays(st) return st.freed == nil or st.freed == 'end' end
  local layer_kept = concat(filter(lf, stays), filter(lb, stays))
  local kept_fwd = filter(lf, function(st) return st.freed ~= 'forward' end)
  return {
    forward = forward, peak = S.peak, at_peak = S.at_peak, backward = S.at_peak.act - forward,
    checkpointing = checkpointing, recomputes = checkpointing or F ~= nil,
    peak_at = S.peak_at, n_layer = L, units = d, logits = block(B * d.T * d.V * sizes.a),
    layer_forward = sum_bytes(lf), layer_forward_kept = sum_bytes(kept_fwd), layer_backward = sum_bytes(lb),
    layer_kept = sum_bytes(layer_kept),
    formula = { layer_forward = formula(lf), layer_forward_kept = formula(kept_fwd), layer_backward = formula(lb),
                layer_kept = formula(layer_kept), outside_forward = formula(outside_f),
                outside_backward = formula(outside_b) },
  }
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
    local sends = {}
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
      sends[#sends + 1] = block(padded * sp)
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
      if bf16 then r.master = r.master + block(per * g.numel * 4) end   -- the stack slice's master
    end
    if stage == 1 then
      r.notes.grads = 'views of flat buffers (padded to a multiple of the ranks)'
      r.notes.comm = 'the gradient shards the reduce-scatters fill'
    else
      r.notes.grads = 'the reduce-scattered shards; tensors under 1024 elements whole'
      -- a bucket's send buffer lives from its first gradient until its
      -- reduce-scatter completes: at once in a one-rank world; on MPI ranks
      -- the plan counts one filling while the one before reduces
      table.sort(sends, function(a, b) return a > b end)
      if r.local_comm then
        r.comm_fb = sends[1] or 0
        r.notes.comm = 'the send buffer of the bucket being filled during backward'
      else
        r.comm_fb = (sends[1] or 0) + (sends[2] or 0)
        r.notes.comm = 'send buffers of the two largest buckets in flight during backward'
      end
    end
  end
end
POLICY.zero1, POLICY.zero2 = zero(1), zero(2)

-- FSDP (gptlua.dist.fsdp): units = the embeddings, each block, the head
-- (what is left: ln_f or lm_head), each one flat buffer padded to a
-- multiple of n of which every rank keeps c = ceil(unit/n) elements: the
-- parameter shard and the gradient shard (parameter dtype; for a bfloat16
-- model also an fp32 master shard, which the optimizer updates), AdamW
-- m+v fp32 for the adamw parameters' part of the rank's range, Muon
-- momentum fp32 of the whole matrices the rank owns (greedy by size over
-- the ranks, ties to the rank holding more of the matrix).  Per rank: the
-- busiest rank.  The gathered units and full gradients come from the dry
-- run of the step (sim_fsdp).
local function fsdp_layout(m, cfg, n)
  local units = {}
  for i = 0, m.n_layer + 1 do units[i] = { numel = 0, params = {} } end
  for _, q in ipairs(m.params) do
    local u = units[q.unit]
    u.params[#u.params + 1] = { q = q, off = u.numel }
    u.numel = u.numel + q.numel
  end
  -- the rank's optimizer state: AdamW pieces, then Muon owners
  local opt, owned, nsend, nrecv, pieces = {}, {}, {}, {}, {}
  for s = 0, n - 1 do opt[s], owned[s], nsend[s], nrecv[s], pieces[s] = 0, {}, 0, 0, {} end
  local load = {}
  for s = 0, n - 1 do load[s] = 0 end
  -- self.units order: the blocks, then the embeddings, then the head
  local order = {}
  for i = 1, m.n_layer do order[#order + 1] = units[i] end
  order[#order + 1], order[#order + 2] = units[0], units[m.n_layer + 1]
  for _, u in ipairs(order) do
    local c = math.ceil(u.numel / n)
    u.c = c
    for s = 0, n - 1 do
      local nadam = 0
      for _, e in ipairs(u.params) do
        local held = math.max(0, math.min(e.off + e.q.numel, (s + 1) * c) - math.max(e.off, s * c))
        if optimizer_of(cfg, e.q) == 'adamw' then nadam = nadam + held end
      end
      if nadam > 0 then opt[s] = opt[s] + 2 * block(nadam * 4) end
    end
    for _, e in ipairs(u.params) do
      if optimizer_of(cfg, e.q) == 'muon' then
        local best, held = nil, {}
        for s = 0, n - 1 do
          held[s] = math.max(0, math.min(e.off + e.q.numel, (s + 1) * c) - math.max(e.off, s * c))
          if not best or load[s] < load[best] or (load[s] == load[best] and held[s] > held[best]) then best = s end
        end
        load[best] = load[best] + e.q.numel
        owned[best][#owned[best] + 1] = e.q
        opt[best] = opt[best] + block(e.q.numel * 4)
        for s = 0, n - 1 do
          if held[s] > 0 then nsend[s] = nsend[s] + held[s]; pieces[s][#pieces[s] + 1] = held[s] end
        end
        nrecv[best] = nrecv[best] + e.q.numel
      end
    end
  end
  return units, opt, owned, nsend, nrecv, pieces
end

function POLICY.fsdp(m, cfg, n, sizes, r)
  local sp = sizes.p
  local units, opt, owned, nsend, nrecv, pieces = fsdp_layout(m, cfg, n)
  r.fsdp_masters = cfg.dtype == 'bfloat16'   -- optim.needs_master
  for i = 0, m.n_layer + 1 do
    if units[i].numel > 0 then
      r.params = r.params + block(units[i].c * sp)
      r.grads = r.grads + block(units[i].c * sp)
      if r.fsdp_masters then r.master = r.master + block(units[i].c * 4) end
    end
  end
  local busiest = 0   -- the rank with the most optimizer state
  for s = 1, n - 1 do if opt[s] > opt[busiest] then busiest = s end end
  r.optimizer = opt[busiest]
  -- the step's Muon exchange (optimizer_step_bytes): the rank's pieces to
  -- the owners and back, the matrices it owns
  r.muon_owned = owned[busiest]
  if #muon_groups(m, cfg) > 0 then
    r.muon_exchange = { nsend = nsend[busiest], nrecv = nrecv[busiest], pieces = pieces[busiest] }
  end
  r.notes.grads = 'shards of the flat units'
  if r.fsdp_masters then
    r.notes.master = ('fp32 shards of the flat units: %.2fM x 4 B / %d ranks'):format(m.num_params / 1e6, n)
  end
  r.fsdp = true
end
POLICY.hsdp = POLICY.fsdp

-- per-rank bytes of the persistent components for policy `pol` sharded
-- over n ranks (the world; shard_size for hsdp)
local function persistent(m, cfg, pol, n, sizes, local_comm)
  local r = { params = 0, grads = 0, optimizer = 0, master = 0, gathered = 0, comm = 0, comm_fb = 0, step_extra = 0,
              buffers = 0, notes = {}, local_comm = local_comm }
  for _, b in ipairs(m.buffers) do r.buffers = r.buffers + block(b.numel * sizes.p) end
  POLICY[pol](m, cfg, n, sizes, r)
  return r
end

-- The optimizer step's temporaries (inside the trainer's step scope),
-- replayed allocation by allocation on a running total: the peak is the
-- allocator's.  AdamW updates in place; Muon, per matrix, in the order the
-- policy runs them:
--   optim.Muon.update_direction: the momentum direction upd (fp32 r x c,
--     r = min(rows, cols), c = max), Newton–Schulz on the wide orientation:
--     X/|X|, then per iteration A = X X^T, B = A A, b*A added into B,
--     X' = B X, a*X added into X' (r x r and r x c, fp32), each released
--     as soon as it is used; for a tall matrix a contiguous copy of upd^T
--     on the way in and of X^T on the way out.  The transposed view of a
--     tall matrix's upd is left in the step's scope: its upd stays to the
--     end of the step.
--   none/ddp (optim.Muon:step, in model order) and zero1/zero2 (the
--     rank's matrices of each Muon stack, stacks in bucket order: the
--     last-used shape first): X cast to the update target's dtype (the
--     parameter, or its fp32 master), the scaled update, all released
--     before the next matrix;
--   fsdp/hsdp: the rank's pieces to the owners (send, recv), each owned
--     matrix's whole gradient, X (and its cast to the updates' dtype), the
--     updates back, each applied through a scaled copy; all but the scaled
--     copies stay viewed until the step ends.
local function step_counter()
  local c = { cur = 0, peak = 0 }
  function c.new(b) c.cur = c.cur + b; if c.cur > c.peak then c.peak = c.cur end; return b end
  function c.free(b) c.cur = c.cur - b end
  return c
end

-- optim.Muon.update_direction on the counter: leaves X (fp32) live
local function update_direction(c, shape)
  local rows, cols = shape[1], shape[2]
  local r, k = math.min(rows, cols), math.max(rows, cols)
  local X, A = block(r * k * 4), block(r * r * 4)
  local tall = rows > cols
  c.new(X)                                -- upd
  if tall then c.new(X) end               -- upd^T, contiguous
  c.new(X)                                -- X / |X|
  if tall then c.free(X) end
  for _ = 1, NS_STEPS do
    c.new(A); c.new(A)                    -- A = X X^T, B = A A
    c.new(A); c.free(A)                   -- b*A, added into B
    c.new(X); c.new(X); c.free(X)         -- X' = B X; a*X, added into X'
    c.free(A); c.free(A); c.free(X)       -- A, B and the old X go
  end
  if tall then c.new(X); c.free(X) end    -- X^T, contiguous, replaces X
  c.free(X)                               -- upd goes
  return X
end

local function optimizer_step_bytes(m, cfg, pol, n, sizes, per)
  local c, sp = step_counter(), sizes.p
  if per.fsdp then
    local x = per.muon_exchange
    if not x then return 0 end
    local ub = per.fsdp_masters and 4 or sp      -- the updates' dtype: the masters'
    c.new(block(x.nsend * sp))                   -- send
    c.new(block(x.nrecv * sp))                   -- recv
    if ub ~= sp then c.new(block(x.nrecv * ub)) end
    for _, q in ipairs(per.muon_owned) do
      c.new(block(q.numel * sp))                 -- the whole gradient
      update_direction(c, q.shape)
      if ub ~= 4 then c.new(block(q.numel * ub)) end
    end
    c.new(block(x.nsend * ub))                   -- the updates back
    for _, len in ipairs(x.pieces) do c.free(c.new(block(len * ub))) end
    return c.peak
  end
  -- the matrices in the order they are updated: the rank's matrices of
  -- each zero stack, or all of them in model order
  local list = {}
  if POLICY_RANK[pol] >= POLICY_RANK.zero1 then
    local groups = muon_groups(m, cfg)
    for i = #groups, 1, -1 do
      for _ = 1, ceil_div(groups[i].count, n) do list[#list + 1] = groups[i] end
    end
  else
    for _, q in ipairs(m.params) do if optimizer_of(cfg, q) == 'muon' then list[#list + 1] = q end end
  end
  local tb = sp == 8 and 8 or 4   -- the update target: the parameter, or its fp32 master
  for _, q in ipairs(list) do
    local X = update_direction(c, q.shape)
    local cast = tb ~= 4 and c.new(block(q.numel * tb)) or 0
    c.free(c.new(block(q.numel * tb)))                   -- the scaled update
    c.free(X); c.free(cast)
  end
  return c.peak
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
  args = args or {}
  local i = 0
  while i < #args do
    i = i + 1
    local a = args[i]
    local k, v = tostring(a):match('^%-%-([%w_%-]+)=(.*)$')
    k = k and k:gsub('%-', '_')
    local bare = tostring(a):match('^%-%-([%w_%-]+)$')
    if bare and (PLAN_OPTS[bare:gsub('%-', '_')] or bare == 'device') then
      -- --world 8 as --world=8
      local nxt = args[i + 1]
      if nxt == nil or tostring(nxt):sub(1, 2) == '--' then fail(('--%s needs a value: --%s=VALUE'):format(bare, bare)) end
      k, v, i = bare:gsub('%-', '_'), tostring(nxt), i + 1
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
  local cfg, hooks, launch = train.resolve_config(copy, rargs)
  if device == 'auto' then device = require('gptlua').default_device() end
  require('gptlua.tensor').device_id(device, 'config: device')
  cfg.device = device
  if launch.dtype_auto then cfg.dtype = train.auto_dtype(device) end
  if hooks.build_model then fail('the recipe builds its own model (build_model); the planner knows gpt2 and nanochat') end
  if hooks.build_optimizer then fail('the recipe builds its own optimizer (build_optimizer); the planner knows adamw and nanochat') end
  if hooks.fsdp_units and (cfg.dist == 'fsdp' or cfg.dist == 'hsdp') then
    fail("the recipe gives its own FSDP units (fsdp_units); the planner knows the default ones (blocks, embeddings, head)")
  end
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
  local sizes = { a = sp, p = sp, f = cfg.dtype == 'float64' and 8 or 4, f32 = 4, bf16 = 2, f64 = 8, i64 = 8 }
  local pol = cfg.dist
  local n = pol == 'hsdp' and o.shard or (pol == 'none' and 1 or o.world)
  local per = persistent(m, cfg, pol, n, sizes, o.world == 1)
  -- zero2 frees the gradients of its flat buckets once moved into a send
  -- buffer: backward makes each afresh; FSDP runs its units in the dry run
  local polsim
  if per.fsdp then
    local fo = cfg.fsdp or {}
    polsim = { fsdp = { n = n, accum = o.accum, local_comm = o.world == 1, dtype = cfg.dtype,
      reshard = fo.reshard_after_forward ~= false, prefetch = fo.prefetch ~= false,
      accumulate = fo.accumulate or 'sharded', reduce_dtype = fo.reduce_dtype or 'float32' } }
  elseif pol == 'zero2' then
    polsim = { taken = function(q) return optimizer_of(cfg, q) == 'muon' or q.numel >= MIN_SHARD end }
  end
  local act = activations(m, cfg.batch_size, sizes, cfg.activation_checkpointing, polsim)
  local other = activations(m, cfg.batch_size, sizes, not cfg.activation_checkpointing, polsim)
  local muon_step = optimizer_step_bytes(m, cfg, pol, n, sizes, per)
  local step = muon_step + per.step_extra
  -- persistent state lives through the whole step; activations, gathered
  -- parameters and in-flight buffers only through forward and backward
  -- (FSDP: as the dry run had them at its peak), Muon's temporaries only
  -- through the optimizer step
  local gathered = per.fsdp and act.at_peak.gathered or per.gathered
  local comm_fb = per.fsdp and act.at_peak.comm or per.comm_fb
  if per.fsdp then
    per.notes.gathered = 'units gathered at the peak (embeddings, head, blocks in use or prefetched)'
    per.notes.comm = 'full unit gradients at the peak (filling, or waiting for their reduce-scatter)'
  end
  local function fb(a) return a.peak + (per.fsdp and 0 or per.gathered + per.comm_fb) end
  local b = { params = per.params + per.buffers, grads = per.grads, optimizer = per.optimizer, master = per.master,
              gathered = gathered, comm = per.comm + comm_fb, act_forward = act.forward,
              act_backward = act.backward, activations = act.at_peak.act, optimizer_step = step }
  b.persistent = b.params + b.grads + b.optimizer + b.master + per.comm
  b.forward_backward = fb(act)
  b.total = b.persistent + math.max(b.forward_backward, step)
  local with_ac = cfg.activation_checkpointing and act or other
  local without_ac = cfg.activation_checkpointing and other or act
  local step_notes = {}
  if muon_step > 0 then
    step_notes[#step_notes + 1] = per.fsdp and 'Muon Newton-Schulz temporaries and the pieces exchanged with the owners'
      or 'Muon Newton-Schulz temporaries'
  end
  if per.step_extra > 0 then step_notes[#step_notes + 1] = 'all-gather staging copies of the shards' end
  per.notes.step = #step_notes > 0 and table.concat(step_notes, ' + ') or 'none (AdamW updates in place)'
  return { model = m, bytes = b, act = act, notes = per.notes, sizes = sizes, shard = n,
           activations = { without_checkpointing = without_ac.at_peak.act, with_checkpointing = with_ac.at_peak.act,
                           forward = act.forward, backward = act.backward, formula = act.formula,
                           layer_forward = act.layer_forward, layer_backward = act.layer_backward,
                           layer_forward_kept = act.layer_forward_kept, layer_kept = act.layer_kept,
                           peak_at = act.peak_at, logits = act.logits, units = act.units, recomputes = act.recomputes },
           total_other_checkpointing = b.persistent + math.max(fb(other), step) }
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

-- "in backward at layer 3's c_fc (recomputed)"
local function describe_peak(at, L)
  if not at then return 'at the start' end
  local part = at.part == 0 and "the embeddings'" or at.part == L + 1 and "the head's" or ("layer %d's"):format(at.part)
  return ('in %s at %s %s%s'):format(at.phase == 'forward' and 'the forward' or 'backward', part, at.what,
    at.recompute and ' (recomputed)' or '')
end
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
    { 'master weights', b.master, r.notes.master or (cfg.dtype == 'bfloat16' and ('fp32 copy: %s x 4 B%s'):format(M_(P),
      sharding >= POLICY_RANK.zero1 and shard or '') or 'none (weights are ' .. cfg.dtype .. ')') },
    { 'gathered parameters', b.gathered, r.notes.gathered or 'none (parameters are whole on every rank)' },
    { 'communication buffers', b.comm, r.notes.comm or 'none' },
    { 'activations, forward', b.act_forward, 'live when the forward ends (formulas below)' },
    { 'activations, backward', b.act_backward, 'what backward adds by the micro-step\'s peak' },
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
  local L, ac = m.n_layer, a.recomputes
  if ac then
    w('  forward, per layer    ', a.formula.layer_forward, ' = ', fmt(a.layer_forward),
      (', one block at a time without recording; kept: %s = %s x %d'):format(a.formula.layer_forward_kept,
        fmt(a.layer_forward_kept), L))
    w('  backward, per layer   ', a.formula.layer_backward, ' = ', fmt(a.layer_backward),
      ', the recomputation included, one block at a time')
  else
    w('  forward, per layer    ', a.formula.layer_forward, ' = ', fmt(a.layer_forward), (' x %d'):format(L))
    w('  backward, per layer   ', a.formula.layer_backward, ' = ', fmt(a.layer_backward), ' (weight gradients included)')
  end
  if ac then
    w('  to the end, per layer ', a.formula.layer_kept, ' = ', fmt(a.layer_kept),
      (" x %d: the block's output, kept by the view recorded for its backward"):format(L))
  elseif a.layer_kept == 0 then
    w('  to the end, per layer nothing: backward releases a layer\'s activations and gradients as it passes it')
  else
    w('  to the end, per layer ', a.formula.layer_kept, ' = ', fmt(a.layer_kept),
      (' x %d: pinned by views until the micro-step ends;'):format(L))
    w('                        the rest goes as backward passes the layer')
  end
  w('  outside the layers    forward ', a.formula.outside_forward)
  w('                        backward ', a.formula.outside_backward)
  w('  logits B*T*V*a        ', fmt(a.logits), ' (and as much again for their gradient)')
  w('  peak                  ', fmt(b.activations), ' = forward ', fmt(b.act_forward), ' + ', fmt(b.act_backward),
    ', ', describe_peak(a.peak_at, L))
  local saves = a.with_checkpointing < a.without_checkpointing
  w(('  without checkpointing %s, with %s (%s)'):format(fmt(a.without_checkpointing), fmt(a.with_checkpointing),
    saves and 'checkpointing keeps each block\'s output and recomputes one block at a time'
      or 'more: with one layer the recomputation adds to what stays'))
  w('')
  w("an estimate, a lower bound: the training step's tensors only; the dataset's token tensors (the loaders')")
  w('and anything else the process holds are not counted, so the real peak is higher')
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
