-- gptlua.models.nanochat — nanochat's modern GPT: rotary embeddings,
-- parameter-free RMSNorm, ReLU² MLP, QK-norm, untied lm_head, no biases,
-- logits soft-capped with tanh.  One dial, depth: n_layer = depth,
-- n_embd = 64 * depth, heads of 128 (any of them can be overridden).
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local common = require 'gptlua.models.common'

local M = {}
M.defaults = { depth = 20, vocab_size = 65536, block_size = 2048, n_layer = false, n_embd = false,
               n_head = false, n_kv_head = false, head_dim = 128, softcap = 15, rope_base = 10000,
               dropout = 0.0, activation_checkpointing = false }

-- resolves the depth dial into concrete sizes
function M.resolve(cfg)
  cfg = common.fill(cfg, M.defaults, 'nanochat')
  if cfg.n_layer == false then cfg.n_layer = cfg.depth end
  if cfg.n_embd == false then cfg.n_embd = 64 * cfg.depth end
  if cfg.n_head == false then cfg.n_head = math.max(1, math.floor(cfg.n_embd / cfg.head_dim)) end
  if cfg.n_kv_head == false then cfg.n_kv_head = cfg.n_head end
  common.check_config(cfg, 'nanochat')
  if (cfg.n_embd / cfg.n_head) % 2 ~= 0 then
    error(('nanochat: head dim %d must be even for rotary embeddings'):format(cfg.n_embd / cfg.n_head), 3)
  end
  return cfg
end

local function norm(x) return gl.rms_norm(x, nil, 1e-6) end

-- Linear init as nanochat: uniform-like spread std 1/sqrt(in); projections
-- into the residual stream start at zero.
local function linear(n_in, n_out, zero)
  return nn.Linear(n_in, n_out, { bias = false, std = zero and 0 or 1 / math.sqrt(n_in) })
end

local Attention = nn.class('NanochatAttention', nn.Module)
function Attention:__init(cfg)
  local C, H, Hkv = cfg.n_embd, cfg.n_head, cfg.n_kv_head
  local D = C / H
  self.H, self.Hkv, self.D = H, Hkv, D
  self:add('c_q', linear(C, H * D))
  self:add('c_k', linear(C, Hkv * D))
  self:add('c_v', linear(C, Hkv * D))
  self:add('c_proj', linear(H * D, C, true))
end
function Attention:forward(x, cos, sin, cache)
  local H, Hkv, D = self.H, self.Hkv, self.D
  local q = self.c_q(x)
  local B, T = q.shape[1], q.shape[2]  -- (under sequence parallelism x holds T/tp rows, q all T)
  q = q:view(B, T, H, D)
  local k = self.c_k(x):view(B, T, Hkv, D)
  local v = self.c_v(x):view(B, T, Hkv, D)
  q, k = norm(gl.rope(q, cos, sin)), norm(gl.rope(k, cos, sin))
  q, k, v = q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3)
  if cache then k, v = common.cache_append(cache, k, v) end
  local y = gl.scaled_dot_product_attention(q, k, v)
  return self.c_proj(y:transpose(2, 3):reshape(B, T, H * D))
end

local MLP = nn.class('NanochatMLP', nn.Module)
function MLP:__init(cfg)
  self:add('c_fc', linear(cfg.n_embd, 4 * cfg.n_embd))
  self:add('c_proj', linear(4 * cfg.n_embd, cfg.n_embd, true))
end
function MLP:forward(x) return common.mlp(self, x, 'relu2') end

local Block = nn.class('NanochatBlock', nn.Module)
function Block:__init(cfg)
  self:add('attn', Attention(cfg))
  self:add('mlp', MLP(cfg))
end
function Block:forward(x, cache)
  local rot = self.rotary
  local s, h = gl.add_rms_norm(x, self.attn(norm(x), rot.cos, rot.sin, cache), nil, 1e-6)  -- x + attn, norm: one pass
  return s + self.mlp(h)
end

local Transformer = nn.class('NanochatTransformer', nn.Module)
function Transformer:__init(cfg)
  self:add('wte', nn.Embedding(cfg.vocab_size, cfg.n_embd, { std = 1.0 }))
  local h = self:add('h', nn.ModuleList())
  for _ = 1, cfg.n_layer do h:append(Block(cfg)) end
end

local GPT = nn.class('Nanochat', nn.Module)
M.GPT = GPT
function GPT:__init(cfg)
  cfg = M.resolve(cfg)
  self.config = cfg
  self:add('transformer', Transformer(cfg))
  self:add('lm_head', nn.Linear(cfg.n_embd, cfg.vocab_size, { bias = false, std = 0.001 }))
  -- rotary tables for every position: (block_size, D/2), not saved
  local D = cfg.n_embd / cfg.n_head
  local T = cfg.block_size
  local cos, sin = {}, {}
  for t = 1, T do
    cos[t], sin[t] = {}, {}
    for i = 1, D / 2 do
      local ang = (t - 1) / cfg.rope_base ^ ((2 * (i - 1)) / D)
      cos[t][i], sin[t][i] = math.cos(ang), math.sin(ang)
    end
  end
  self:buffer('rope_cos', gl.tensor(cos), false)
  self:buffer('rope_sin', gl.tensor(sin), false)
end

function GPT:forward(idx, targets, caches)
  local T = idx.shape[2]
  local cfg = self.config
  local start = caches and caches[1].pos or 0
  if start + T > cfg.block_size then
    error(('nanochat: sequence of %d tokens exceeds block_size %d'):format(start + T, cfg.block_size), 2)
  end
  local tr = self.transformer
  local rot = { cos = self.rope_cos:narrow(1, start + 1, T), sin = self.rope_sin:narrow(1, start + 1, T) }
  if rot.cos.dtype ~= tr.wte.weight.dtype or rot.cos.device ~= tr.wte.weight.device then
    local to = { dtype = tr.wte.weight.dtype, device = tr.wte.weight.device }
    rot.cos, rot.sin = rot.cos:to(to), rot.sin:to(to)
  end
  rot.cos, rot.sin = rot.cos:contiguous(), rot.sin:contiguous()
  local x = norm(tr.wte(idx))
  for i = 1, tr.h.n do
    tr.h[i].rotary = rot
    x = common.run_block(tr.h[i], x, caches and caches[i], cfg)
  end
  x = norm(x)
  return common.head(self, x, targets, gl.linear, self.lm_head.weight, cfg.softcap)
end

-- training FLOPs per token; the token embedding is only looked up
function GPT:flops_per_token(T) return common.flops_per_token(self, self.transformer.wte.weight, T) end

function GPT:new_caches(B, S)
  local cfg = self.config
  return common.new_caches(cfg.n_layer, B, cfg.n_kv_head, S, cfg.n_embd / cfg.n_head, self.lm_head.weight)
end
GPT.generate = common.generate
nn.checked(GPT, { __init = 'self:module, cfg:opts?',
                  forward = 'self:module, idx:tensor, targets:tensor?, caches:opts?',
                  generate = 'self:module, idx:tensor, n:size, opts:opts?',
                  new_caches = 'self:module, batch:count, length:count' })

return M
