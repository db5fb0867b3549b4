-- gptlua.models.nanochat — nanochat's modern GPT: rotary embeddings,
-- parameter-free RMSNorm, ReLU² MLP, QK-norm, untied lm_head, no biases,
-- logits soft-capped with tanh.  One dial, depth: n_layer = depth,
-- n_embd = 64 * depth, heads of 128 (any of them can be overridden).
--
-- Two versions, picked by `version` (each feature below is also a key of
-- its own; 'auto' takes the version's value):
--   'v1'  the model gptlua has trained since its first release (nanochat's
--         first release as gptlua wrote it: rope base 10000, RMSNorm eps
--         1e-6, full attention everywhere, its own init).  The default, so
--         recipes and checkpoints that name no version keep their results.
--   'v2'  nanochat at commit 92d63d4 (github.com/karpathy/nanochat,
--         nanochat/gpt.py), written here from its definitions:
--     qk_scale 1.2      q and k multiplied by 1.2 after the QK-norm
--     rope_base 100000
--     norm_eps 'dtype'  F.rms_norm without eps: the machine epsilon of the
--                       type PyTorch computes in (2^-23 for float32, bfloat16
--                       and float16; 2^-52 for float64)
--     lambdas           before block i: x = resid_lambdas[i] x + x0_lambdas[i] x0,
--                       x0 the (smeared) normed embedding; init 1.15 - 0.10 i/(L-1)
--                       and 0.20 - 0.15 i/(L-1)
--     value_embeds      layers i with i % 2 == (L-1) % 2 (0-based; the last
--                       always) add a per-layer token embedding (kv width) to v,
--                       gated per KV head: v += 3 sigmoid(ve_gate(x[..., :12])) ve
--     smear             x[t] += smear_lambda sigmoid(smear_gate(x[t, :24])) x[t-1]
--                       on the normed embedding (generation keeps x[t-1])
--     backout           x -= backout_lambda h, h the residual stream after
--                       block L//2 (0-based), before the final norm
--     window_pattern 'SSSL'  tiled over the layers, the last layer always L;
--                       L sees the whole context, S `short_window` tokens back
--                       (0: nanochat's rule, a quarter of block_size rounded up
--                       to a multiple of 128); FA3's window (w, 0) lets a query
--                       see w keys back plus itself, which is gl's window w + 1
--     pad_vocab_to 64   embedding and head rows padded; logits cut to vocab_size
--     init 'v2'         nanochat's init_weights: wte N(0, 0.8), lm_head N(0, 0.001),
--                       c_q/c_k/c_v U(+-s), c_fc U(+-0.4 s), s = sqrt(3/n_embd),
--                       projections 0, value embeddings U(+-s), gates U(0, 0.02),
--                       smear_lambda 0, backout_lambda 0.2
--     and n_embd from depth rounded up to a multiple of head_dim (base_train.py).
--   Deliberate differences from 92d63d4: the 1.2 on q and k is folded into the
--   attention's scale (1.44 / sqrt(D): the same scores, one op less); the
--   rotary tables are computed in double precision and rounded once to the
--   model's dtype (nanochat computes them in float32); the last chunk of a
--   prefill with a KV cache smears its first token with the cached previous
--   one (nanochat only prefills from position 0, where the two agree).
-- Both versions run under every parallel layout (tensor and sequence,
-- context, pipeline: gptlua.dist's headers say how each cuts v2's features;
-- ring attention alone refuses the sliding windows).
-- The parameter names are nanochat's (resid_lambdas, x0_lambdas, smear_gate,
-- smear_lambda, backout_lambda, value_embeds.<layer, 0-based>, ve_gate).
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local common = require 'gptlua.models.common'
local moe = require 'gptlua.moe'

local M = {}

-- every feature's value in each version
M.versions = {
  v1 = { qk_scale = 1, rope_base = 10000, norm_eps = 1e-6, window_pattern = 'L', short_window = 0,
         value_embeds = false, smear = false, backout = false, lambdas = false, pad_vocab_to = 1, init = 'v1' },
  v2 = { qk_scale = 1.2, rope_base = 100000, norm_eps = 'dtype', window_pattern = 'SSSL', short_window = 0,
         value_embeds = true, smear = true, backout = true, lambdas = true, pad_vocab_to = 64, init = 'v2' },
}
M.FEATURES = { 'qk_scale', 'rope_base', 'norm_eps', 'window_pattern', 'short_window', 'value_embeds', 'smear',
               'backout', 'lambdas', 'pad_vocab_to', 'init' }

M.defaults = { depth = 20, vocab_size = 65536, block_size = 2048, n_layer = false, n_embd = false,
               n_head = false, n_kv_head = false, head_dim = 128, softcap = 15,
               dropout = 0.0, activation_checkpointing = false, version = 'v1', pad_vocab_for_tp = 1,
               moe = false }
for _, k in ipairs(M.FEATURES) do M.defaults[k] = 'auto' end

local VE_GATE_CHANNELS, SMEAR_CHANNELS = 12, 24

local function bad(k, want, v)
  error(('nanochat: %s must be %s, got %s'):format(k, want, type(v) == 'string' and "'" .. v .. "'" or tostring(v)), 4)
end
local function posnum(v) return type(v) == 'number' and v > 0 and v < math.huge end

-- resolves the version's features and the depth dial into concrete sizes
function M.resolve(cfg)
  cfg = common.fill(cfg, M.defaults, 'nanochat')
  local ver = M.versions[cfg.version]
  if not ver then bad('version', "'v1' or 'v2'", cfg.version) end
  for _, k in ipairs(M.FEATURES) do if cfg[k] == 'auto' then cfg[k] = ver[k] end end
  if not posnum(cfg.qk_scale) then bad('qk_scale', 'a positive number', cfg.qk_scale) end
  if not posnum(cfg.rope_base) then bad('rope_base', 'a positive number', cfg.rope_base) end
  if cfg.norm_eps ~= 'dtype' and not (type(cfg.norm_eps) == 'number' and cfg.norm_eps >= 0 and cfg.norm_eps < 1) then
    bad('norm_eps', "a number in [0, 1) or 'dtype'", cfg.norm_eps)
  end
  if type(cfg.window_pattern) ~= 'string' or not cfg.window_pattern:upper():match('^[SL]+$') then
    bad('window_pattern', "a string of S and L (e.g. 'SSSL')", cfg.window_pattern)
  end
  local sw = cfg.short_window
  if type(sw) ~= 'number' or sw < 0 or sw ~= math.floor(sw) then bad('short_window', 'an integer >= 0', sw) end
  for _, k in ipairs({ 'value_embeds', 'smear', 'backout', 'lambdas' }) do
    if type(cfg[k]) ~= 'boolean' then bad(k, 'true or false', cfg[k]) end
  end
  local pv = cfg.pad_vocab_to
  if type(pv) ~= 'number' or pv < 1 or pv ~= math.floor(pv) then bad('pad_vocab_to', 'a positive integer', pv) end
  if cfg.init ~= 'v1' and cfg.init ~= 'v2' then bad('init', "'v1' or 'v2'", cfg.init) end
  if cfg.n_layer == false then cfg.n_layer = cfg.depth end
  if cfg.n_embd == false then
    cfg.n_embd = 64 * cfg.depth
    if cfg.version == 'v2' then cfg.n_embd = math.ceil(cfg.n_embd / cfg.head_dim) * cfg.head_dim end
  end
  if cfg.n_head == false then cfg.n_head = math.max(1, math.floor(cfg.n_embd / cfg.head_dim)) end
  if cfg.n_kv_head == false then cfg.n_kv_head = cfg.n_head end
  common.check_config(cfg, 'nanochat')
  cfg.moe = moe.model_config(cfg.moe, cfg.n_embd, 'nanochat')
  if (cfg.n_embd / cfg.n_head) % 2 ~= 0 then
    error(('nanochat: head dim %d must be even for rotary embeddings'):format(cfg.n_embd / cfg.n_head), 3)
  end
  if cfg.smear and cfg.n_embd < SMEAR_CHANNELS then
    error(('nanochat: smear reads the first %d channels, n_embd is %d'):format(SMEAR_CHANNELS, cfg.n_embd), 3)
  end
  if cfg.value_embeds and cfg.n_embd < VE_GATE_CHANNELS then
    error(('nanochat: value_embeds gates read the first %d channels, n_embd is %d'):format(VE_GATE_CHANNELS, cfg.n_embd), 3)
  end
  -- the rows a checkpoint holds (pad_vocab_to's), and the rows the model
  -- holds: those padded on to a multiple of the tp size that will cut them
  -- (the trainer's pad_vocab_for_tp; gptlua.dist.tensor_parallel masks the
  -- padding in the loss, never samples it and saves the stored rows only)
  local t = cfg.pad_vocab_for_tp
  if type(t) ~= 'number' or t < 1 or t ~= math.floor(t) then bad('pad_vocab_for_tp', 'a positive integer', t) end
  cfg.stored_vocab_size = math.ceil(cfg.vocab_size / pv) * pv
  cfg.padded_vocab_size = math.ceil(cfg.stored_vocab_size / t) * t
  return cfg
end

-- The trainer's `nanochat` table (gptlua.train's defaults: 0, '' and 'auto'
-- take the version's value) as model keys; a bad value is a one-line error
-- naming nanochat.KEY.  Booleans come as true/false or, from the command
-- line, 'true'/'false'/'on'/'off'.
M.TRAINER_DEFAULTS = { version = 'v1', qk_scale = 0, rope_base = 0, norm_eps = 0, window_pattern = '',
                       short_window = 0, value_embeds = 'auto', smear = 'auto', backout = 'auto', lambdas = 'auto',
                       pad_vocab_to = 0, init = '' }
function M.trainer_defaults()
  local t = {}
  for k, v in pairs(M.TRAINER_DEFAULTS) do t[k] = v end
  return t
end
local FLAG_WORDS = { ['true'] = true, on = true, yes = true, ['1'] = true,
                     ['false'] = false, off = false, no = false, ['0'] = false }
function M.trainer_keys(t)
  local out = {}
  for k, v in pairs(t or {}) do
    local d = M.TRAINER_DEFAULTS[k]
    if d == nil then error(('nanochat.%s is not a nanochat key'):format(tostring(k)), 0) end
    if v ~= d then
      if d == 'auto' and type(v) ~= 'boolean' then
        if FLAG_WORDS[v] == nil then
          error(("nanochat.%s must be true, false or 'auto', got %s"):format(k, tostring(v)), 0)
        end
        v = FLAG_WORDS[v]
      end
      out[k] = v
    end
  end
  local ok, err = pcall(M.resolve, out)  -- the model's checks, with the trainer's name for the key
  if not ok and not tostring(err):match('unknown model option') then
    local msg = tostring(err):gsub('^.-nanochat: (%w+)', 'nanochat.%1')
    error(msg, 0)
  end
  return out
end

-- The first feature on which two trainer `nanochat` tables describe
-- different models, with both values; nil when they agree.  A checkpoint
-- from before the versions has no table: the first-release model.
function M.config_mismatch(theirs, ours)
  local function features(t)
    local cfg = M.resolve(M.trainer_keys(t or { version = 'v1' }))
    return cfg
  end
  local a, b = features(theirs), features(ours)
  for _, k in ipairs({ 'version', unpack(M.FEATURES) }) do
    if a[k] ~= b[k] then return k, a[k], b[k] end
  end
  return nil
end

-- true when cfg (resolved) is the first-release model in every feature
function M.first_release(cfg)
  for _, k in ipairs(M.FEATURES) do if cfg[k] ~= nil and cfg[k] ~= M.versions.v1[k] then return false end end
  return true
end

-- nanochat's window of layer i (1-based) as FA3's (left, 0): keys back from
-- the query, block_size for L; the last layer is always L
function M.window_left(cfg, i)
  local long = cfg.block_size
  local p = cfg.window_pattern:upper()
  local c = i == cfg.n_layer and 'L' or p:sub((i - 1) % #p + 1, (i - 1) % #p + 1)
  if c == 'L' then return long end
  if cfg.short_window > 0 then return cfg.short_window end
  return math.ceil(math.ceil(long / 4) / 128) * 128  -- -(-long // 4 // 128) * 128
end

-- layers with value embeddings (0-based i as nanochat: i % 2 == (L - 1) % 2)
function M.has_ve(cfg, i) return cfg.value_embeds and (i - 1) % 2 == (cfg.n_layer - 1) % 2 end

-- the norm's eps for activations of dtype: F.rms_norm without eps takes the
-- epsilon of its accumulation type (at::opmath_type), float32 for the 16-bit
-- dtypes, not the epsilon of the 16-bit type itself (2^-7 for bfloat16)
local MACHINE_EPS = { float32 = 2 ^ -23, float64 = 2 ^ -52, bfloat16 = 2 ^ -23, float16 = 2 ^ -23 }
M.MACHINE_EPS = MACHINE_EPS
local function eps_for(cfg, dtype)
  if cfg.norm_eps ~= 'dtype' then return cfg.norm_eps end
  return MACHINE_EPS[dtype] or error('nanochat: no machine epsilon known for dtype ' .. tostring(dtype), 3)
end

-- Linear init as nanochat: uniform-like spread std 1/sqrt(in); projections
-- into the residual stream start at zero.
local function linear(n_in, n_out, zero)
  return nn.Linear(n_in, n_out, { bias = false, std = zero and 0 or 1 / math.sqrt(n_in) })
end

local Attention = nn.class('NanochatAttention', nn.Module)
function Attention:__init(cfg, i)
  local C, H, Hkv = cfg.n_embd, cfg.n_head, cfg.n_kv_head
  local D = C / H
  self.H, self.Hkv, self.D = H, Hkv, D
  self:add('c_q', linear(C, H * D))
  self:add('c_k', linear(C, Hkv * D))
  self:add('c_v', linear(C, Hkv * D))
  self:add('c_proj', linear(H * D, C, true))
  if M.has_ve(cfg, i) then self:add('ve_gate', linear(VE_GATE_CHANNELS, Hkv)) end
  -- gl's window counts the query itself; a long window hides nothing
  local left = M.window_left(cfg, i)
  self.window = left < cfg.block_size and left + 1 or 0
  self.scale = cfg.qk_scale ^ 2 / math.sqrt(D)
end
-- x (B,T,C) normed; ve (B,T,Hkv*D) this layer's value embedding or nil;
-- eps the QK-norm's; residual (optional): returns residual + attn(x), the
-- add in c_proj's product
function Attention:forward(x, cos, sin, cache, ve, eps, residual)
  local H, Hkv, D = self.H, self.Hkv, self.D
  eps = eps or 1e-6
  local q = self.c_q(x)
  local B, T = q.shape[1], q.shape[2]  -- (under sequence parallelism x holds T/tp rows, q all T)
  q = q:view(B, T, H, D)
  local k = self.c_k(x):view(B, T, Hkv, D)
  local v = self:value(x, ve, B, T)
  if cos.shape[1] == T then
    q, k = gl.rope_rms_norm(q, cos, sin, eps), gl.rope_rms_norm(k, cos, sin, eps)  -- rotary, then the QK-norm: one op
  else  -- each row's own positions (GPT:prepare): the rows as one sequence of B * T
    q = gl.rope_rms_norm(q:view(1, B * T, H, D), cos, sin, eps):view(B, T, H, D)
    k = gl.rope_rms_norm(k:view(1, B * T, Hkv, D), cos, sin, eps):view(B, T, Hkv, D)
  end
  q, k, v = q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3)
  if cache then k, v = common.cache_append(cache, k, v) end
  local y
  if self.window == 0 and self.scale == 1 / math.sqrt(D) then y = gl.scaled_dot_product_attention(q, k, v)
  else y = gl.scaled_dot_product_attention(q, k, v, { scale = self.scale, window = self.window }) end
  return common.linear(self.c_proj, y:transpose(2, 3):reshape(B, T, H * D), residual)
end

-- the values (B, T, Hkv, D) of x (T rows of the sequence; under sequence
-- parallelism a shard of them, and B, T those of the whole), with the
-- value residual: v + 3 sigmoid(gate) ve, one gate per KV head (the
-- parallel layouts call this with their own rows and heads)
function Attention:value(x, ve, B, T)
  local Hkv, D = self.Hkv, self.D
  local v = self.c_v(x):view(B, T, Hkv, D)
  if ve then
    local gate = gl.sigmoid(self.ve_gate(x:narrow(3, 1, VE_GATE_CHANNELS))) * 3
    v = v + gate:unsqueeze(4) * ve:view(B, T, Hkv, D)
  end
  return v
end

local MLP = nn.class('NanochatMLP', nn.Module)
function MLP:__init(cfg)
  self:add('c_fc', linear(cfg.n_embd, 4 * cfg.n_embd))
  self:add('c_proj', linear(4 * cfg.n_embd, cfg.n_embd, true))
end
-- residual (optional): residual + mlp(x), added in the second product
function MLP:forward(x, residual) return common.mlp(self, x, 'relu2', residual) end

local Block = nn.class('NanochatBlock', nn.Module)
function Block:__init(cfg, i)
  self:add('attn', Attention(cfg, i))
  if moe.is_moe_block(cfg.moe, i) then  -- a mixture of experts in place of the MLP (gptlua.moe)
    self:add('mlp', moe.MoE(cfg.moe, cfg.n_embd, 'relu2', 1 / math.sqrt(cfg.n_embd), 0))
  else
    self:add('mlp', MLP(cfg))
  end
end
-- self.rotary and self.eps are set by GPT:forward for this pass
function Block:forward(x, cache, ve)
  local rot, eps = self.rotary, self.eps or 1e-6
  local h0 = gl.rms_norm(x, nil, eps)
  -- both residual adds ride in the products that make the branches: x + attn
  -- in c_proj's, s + mlp in the MLP's second (gl_matmul_add); each norm's
  -- backward adds the residual stream's gradient in its own pass
  local s = self.attn(h0, rot.cos, rot.sin, cache, ve, eps, x)
  return self.mlp(gl.rms_norm(s, nil, eps), s)
end

local Transformer = nn.class('NanochatTransformer', nn.Module)
function Transformer:__init(cfg)
  self:add('wte', nn.Embedding(cfg.padded_vocab_size, cfg.n_embd, { std = 1.0 }))
  local h = self:add('h', nn.ModuleList())
  for i = 1, cfg.n_layer do h:append(Block(cfg, i)) end
end

-- nanochat's init_weights (92d63d4), in place
local function init_v2(self, cfg)
  local s = math.sqrt(3) / math.sqrt(cfg.n_embd)
  local tr = self.transformer
  gl.no_grad(function()
    tr.wte.weight:normal_(0, 0.8)
    self.lm_head.weight:normal_(0, 0.001)
    for i = 1, tr.h.n do
      local a, m = tr.h[i].attn, tr.h[i].mlp
      a.c_q.weight:uniform_(-s, s); a.c_k.weight:uniform_(-s, s); a.c_v.weight:uniform_(-s, s)
      a.c_proj.weight:zero_()
      local mlps = { m }
      if getmetatable(m) == moe.MoE then  -- each expert (and the shared one) as the dense MLP
        m.router.weight:uniform_(-s, s)
        mlps = {}
        for e = 1, m.experts.n do mlps[e] = m.experts[e] end
        if m.shared then mlps[#mlps + 1] = m.shared end
      end
      for _, mm in ipairs(mlps) do
        mm.c_fc.weight:uniform_(-0.4 * s, 0.4 * s)
        mm.c_proj.weight:zero_()
      end
    end
    if cfg.smear then self.smear_gate.weight:uniform_(0, 0.02) end
    if cfg.value_embeds then
      for i = 1, tr.h.n do
        if M.has_ve(cfg, i) then self.value_embeds[tostring(i - 1)].weight:uniform_(-s, s) end
      end
      for i = 1, tr.h.n do
        local g = tr.h[i].attn.ve_gate
        if g then g.weight:uniform_(0, 0.02) end
      end
    end
  end)
end

-- rotary tables for every position: (block_size, D/2) cos and sin of
-- t / base^(2i/D), computed in double precision, stored as dtype
local function rope_tables(cfg, dtype)
  local D = cfg.n_embd / cfg.n_head
  local cos, sin = {}, {}
  for t = 1, cfg.block_size do
    cos[t], sin[t] = {}, {}
    for i = 1, D / 2 do
      local ang = (t - 1) / cfg.rope_base ^ ((2 * (i - 1)) / D)
      cos[t][i], sin[t][i] = math.cos(ang), math.sin(ang)
    end
  end
  return gl.tensor(cos, { dtype = dtype }), gl.tensor(sin, { dtype = dtype })
end

local GPT = nn.class('Nanochat', nn.Module)
M.GPT = GPT
function GPT:__init(cfg)
  cfg = M.resolve(cfg)
  self.config = cfg
  local L = cfg.n_layer
  self:add('transformer', Transformer(cfg))
  self:add('lm_head', nn.Linear(cfg.n_embd, cfg.padded_vocab_size, { bias = false, std = 0.001 }))
  if cfg.lambdas then
    local r, x0 = {}, {}
    for i = 0, L - 1 do
      r[i + 1] = 1.15 - 0.10 * i / math.max(L - 1, 1)
      x0[i + 1] = 0.20 - 0.15 * i / math.max(L - 1, 1)
    end
    self:param('resid_lambdas', gl.tensor(r))
    self:param('x0_lambdas', gl.tensor(x0))
  end
  if cfg.smear then
    self:add('smear_gate', linear(SMEAR_CHANNELS, 1))
    self:param('smear_lambda', gl.zeros({ 1 }))
  end
  if cfg.backout then self:param('backout_lambda', gl.full({ 1 }, 0.2)) end
  if cfg.value_embeds then
    local D = cfg.n_embd / cfg.n_head
    local ve = self:add('value_embeds', nn.Module())
    for i = 1, L do
      if M.has_ve(cfg, i) then ve:add(tostring(i - 1), nn.Embedding(cfg.padded_vocab_size, cfg.n_kv_head * D)) end
    end
  end
  if cfg.init == 'v2' then init_v2(self, cfg) end
  local cos, sin = rope_tables(cfg, 'float32')
  self:buffer('rope_cos', cos, false)
  self:buffer('rope_sin', sin, false)
end

-- moves/casts as every module; a float64 model gets its rotary tables
-- computed again in double precision rather than widened from float32
function GPT:to(device_or_dtype)
  nn.Module.to(self, device_or_dtype)
  if self.rope_cos.dtype == 'float64' then
    local cos, sin = rope_tables(self.config, 'float64')
    self.rope_cos:copy_(cos:to(self.rope_cos.device)); self.rope_sin:copy_(sin:to(self.rope_sin.device))
  end
  return self
end

-- the smear of the normed embedding x (B,T,C): each position adds the gated
-- previous one; with KV caches the previous position of the last call is kept
function GPT:smear(x, caches)
  local B, T, C = x.shape[1], x.shape[2], x.shape[3]
  local prev = caches and caches.smear and caches.smear.filled and caches.smear.x or nil
  local lam = self.smear_lambda
  local out
  if prev then
    out = self:smear_shifted(x, T > 1 and gl.cat({ prev, x:narrow(2, 1, T - 1) }, 2) or prev)
  elseif T > 1 then
    local rest = x:narrow(2, 2, T - 1)
    local gate = gl.sigmoid(self.smear_gate(rest:narrow(3, 1, SMEAR_CHANNELS))) * lam
    out = gl.cat({ x:narrow(2, 1, 1), rest + gate * x:narrow(2, 1, T - 1) }, 2)
  else
    out = x
  end
  if caches and caches.smear then
    caches.smear.x:copy_(x:narrow(2, T, 1))
    caches.smear.filled = true
  end
  return out
end

-- the smear given each position's previous one: x + gate(x) shifted, with
-- shifted (B, T, C) the normed embedding one position back (zeros where
-- there is none); the parallel layouts, whose rows are parts of the
-- sequence, bring the previous positions from the ranks that hold them
function GPT:smear_shifted(x, shifted)
  local gate = gl.sigmoid(self.smear_gate(x:narrow(3, 1, SMEAR_CHANNELS))) * self.smear_lambda
  return x + gate * shifted
end

-- The forward in its parts, which pipeline stages run apart
-- (gptlua.dist.pipeline's adapter):
--   prepare(start, T)   every block's rotary rows and norm eps for positions
--                       start .. start+T-1; returns the eps
--   embed(idx, caches)  the normed (smeared) embedding: x, also x0
--   layer(i, x, x0, idx, cache)  block i after its lambdas, with its value
--                       embedding of idx
--   finish(x, x_backout, targets)  the backout, final norm and head
-- M.backout_at(cfg): the block whose output the backout subtracts.
function M.backout_at(cfg) return cfg.backout and math.floor(cfg.n_layer / 2) + 1 or nil end

-- positions (optional): each row's (B, T), for a batch of prompts of
-- different lengths (gptlua.infer): the tables' rows gathered, (B * T, D/2),
-- which Attention:forward applies to the batch's rows as one sequence
function GPT:prepare(start, T, positions)
  local tr = self.transformer
  local rot
  if positions then
    local flat = positions:reshape(positions:numel())
    if flat.device ~= self.rope_cos.device then flat = flat:to(self.rope_cos.device) end
    rot = { cos = gl.index_select(self.rope_cos, 1, flat), sin = gl.index_select(self.rope_sin, 1, flat) }
  else
    rot = { cos = self.rope_cos:narrow(1, start + 1, T), sin = self.rope_sin:narrow(1, start + 1, T) }
  end
  if rot.cos.dtype ~= tr.wte.weight.dtype or rot.cos.device ~= tr.wte.weight.device then
    local to = { dtype = tr.wte.weight.dtype, device = tr.wte.weight.device }
    rot.cos, rot.sin = rot.cos:to(to), rot.sin:to(to)
  end
  rot.cos, rot.sin = rot.cos:contiguous(), rot.sin:contiguous()
  local eps = eps_for(self.config, tr.wte.weight.dtype)
  for i = 1, tr.h.n do tr.h[i].rotary, tr.h[i].eps = rot, eps end
  return eps
end

function GPT:embed(idx, caches)
  local x = gl.rms_norm(self.transformer.wte(idx), nil, eps_for(self.config, self.transformer.wte.weight.dtype))
  -- a batch of prompts' left padding (gptlua.infer): zeros there (times 0; the tokens times 1, unchanged),
  -- so a row's first token smears in nothing, as when its prompt is alone
  if caches and caches.real then x = x * caches.real:narrow(2, caches[1].pos + 1, idx.shape[2]) end
  if self.config.smear then x = self:smear(x, caches) end
  return x
end

function GPT:layer(i, x, x0, idx, cache)
  local cfg = self.config
  if cfg.lambdas then
    x = self.resid_lambdas:narrow(1, i, 1) * x + self.x0_lambdas:narrow(1, i, 1) * x0
  end
  local ve = M.has_ve(cfg, i) and self.value_embeds[tostring(i - 1)](idx) or nil
  return common.run_block(self.transformer.h[i], x, cache, cfg, ve)
end

function GPT:finish(x, x_backout, targets)
  local cfg = self.config
  if x_backout then x = x - self.backout_lambda * x_backout end
  x = gl.rms_norm(x, nil, eps_for(cfg, self.transformer.wte.weight.dtype))
  local w = self.lm_head.weight
  -- (a vocabulary-parallel head holds a shard of the padded rows and masks the padding itself)
  if cfg.padded_vocab_size ~= cfg.vocab_size and not self.tp_layout then w = w:narrow(1, 1, cfg.vocab_size) end
  return common.head(self, x, targets, gl.linear, w, cfg.softcap)
end

function GPT:forward(idx, targets, caches)
  local T = idx.shape[2]
  local cfg = self.config
  local start = caches and caches[1].pos or 0
  if start + T > cfg.block_size then
    error(('nanochat: sequence of %d tokens exceeds block_size %d'):format(start + T, cfg.block_size), 2)
  end
  self:prepare(start, T, caches and caches.positions)
  local x = self:embed(idx, caches)
  local x0 = x
  local backout_at, x_backout = M.backout_at(cfg), nil
  for i = 1, self.transformer.h.n do
    x = self:layer(i, x, x0, idx, caches and caches[i])
    if i == backout_at then x_backout = x end
  end
  return self:finish(x, x_backout, targets)
end

-- training FLOPs per token: 6 per weight of every product (the token and
-- value embeddings are only looked up, the lambdas scale), plus 12 C per
-- key a query sees, the window's keys on a short layer (nanochat's
-- estimate_flops); the first-release model counts as it always has
function GPT:flops_per_token(T)
  local cfg = self.config
  local inactive = moe.inactive_params(self)  -- experts a token is not routed to
  if M.first_release(cfg) then return common.flops_per_token(self, self.transformer.wte.weight, T) - 6 * inactive end
  T = T or cfg.block_size
  local N = 0
  for _, np in ipairs(self:named_parameters()) do
    local name = np[1]
    if #np[2].shape == 2 and not name:match('wte') and not name:match('^value_embeds%.') then N = N + np[2]:numel() end
  end
  local attn = 0
  for i = 1, cfg.n_layer do attn = attn + 12 * cfg.n_embd * math.min(M.window_left(cfg, i), T) end
  return 6 * (N - inactive) + attn
end

function GPT:new_caches(B, S)
  local cfg = self.config
  local w = self.lm_head.weight
  -- (KV heads of this rank: tensor parallelism cuts them)
  local caches = common.new_caches(cfg.n_layer, B, self.transformer.h[1].attn.Hkv, S, cfg.n_embd / cfg.n_head, w)
  if cfg.smear then  -- the last position's normed embedding, for the next call's smear
    caches.smear = { x = gl.zeros({ B, 1, cfg.n_embd }, { dtype = w.dtype, device = w.device }), filled = false }
  end
  return caches
end
GPT.generate = common.generate
nn.checked(GPT, { __init = 'self:module, cfg:opts?',
                  forward = 'self:module, idx:ids, targets:ids?, caches:opts?',
                  generate = 'self:module, idx:ids, n:size, opts:opts?',
                  new_caches = 'self:module, batch:count, length:count' })

return M
