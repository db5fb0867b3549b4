-- gptlua.models.gpt2 — GPT-2: learned position embeddings, LayerNorm with
-- bias, GELU (tanh) MLP, lm_head tied to the token embedding, GPT-2's init.
-- Parameter names and shapes follow nanoGPT's layout of the GPT-2
-- checkpoint (transformer.h.N.attn.c_attn.weight, ...); gptlua.hf reads and
-- writes Hugging Face's files (Conv1D weights stored transposed).
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local common = require 'gptlua.models.common'
local moe = require 'gptlua.moe'

local M = {}

local Attention = nn.class('CausalSelfAttention', nn.Module)
function Attention:__init(cfg)
  local C, L = cfg.n_embd, cfg.n_layer
  self.n_head, self.n_embd = cfg.n_head, C
  self:add('c_attn', nn.Linear(C, 3 * C, { bias = cfg.bias }))
  self:add('c_proj', nn.Linear(C, C, { bias = cfg.bias, std = 0.02 / math.sqrt(2 * L) }))
  self.dropout = cfg.dropout or 0
end
-- x (B, T, C); cache (optional) {k=, v=, pos=} for generation
function Attention:forward(x, cache)
  local H = self.n_head
  local qkv = self.c_attn(x)
  local B, T = qkv.shape[1], qkv.shape[2]  -- (under sequence parallelism x holds T/tp rows, qkv all T)
  local y
  if cache then  -- generation: keys and values accumulate in the cache
    local Cq = qkv.shape[3] / 3  -- C, or C/tp under tensor parallelism (H is then the local heads)
    local function heads(i)  -- (B, T, Cq) slice i -> (B, H, T, D)
      return qkv:narrow(3, (i - 1) * Cq + 1, Cq):reshape(B, T, H, Cq / H):transpose(2, 3)
    end
    local k, v = common.cache_append(cache, heads(2), heads(3))
    y = gl.scaled_dot_product_attention(heads(1), k, v):transpose(2, 3):reshape(B, T, Cq)
  else
    y = gl.attention_qkv(qkv, H)  -- reads q, k, v in place, no split copies
  end
  return gl.dropout(self.c_proj(y), self.dropout, self.training)
end

local MLP = nn.class('MLP', nn.Module)
function MLP:__init(cfg)
  local C = cfg.n_embd
  self:add('c_fc', nn.Linear(C, 4 * C, { bias = cfg.bias }))
  self:add('c_proj', nn.Linear(4 * C, C, { bias = cfg.bias, std = 0.02 / math.sqrt(2 * cfg.n_layer) }))
  self.dropout = cfg.dropout or 0
end
function MLP:forward(x)
  return gl.dropout(common.mlp(self, x, 'gelu'), self.dropout, self.training)
end

local Block = nn.class('Block', nn.Module)
function Block:__init(cfg, i)
  self:add('ln_1', nn.LayerNorm(cfg.n_embd, { bias = cfg.bias }))
  self:add('attn', Attention(cfg))
  self:add('ln_2', nn.LayerNorm(cfg.n_embd, { bias = cfg.bias }))
  if moe.is_moe_block(cfg.moe, i) then  -- a mixture of experts in place of the MLP (gptlua.moe; no biases)
    self:add('mlp', moe.MoE(cfg.moe, cfg.n_embd, 'gelu', 0.02, 0.02 / math.sqrt(2 * cfg.n_layer),
      { dropout = cfg.dropout }))
  else
    self:add('mlp', MLP(cfg))
  end
end
function Block:forward(x, cache)
  local s, h = common.add_norm(x, self.attn(self.ln_1(x), cache), self.ln_2)  -- x + attn, then ln_2: one pass
  return s + self.mlp(h)
end

local Transformer = nn.class('Transformer', nn.Module)
function Transformer:__init(cfg)
  self:add('wte', nn.Embedding(cfg.padded_vocab_size, cfg.n_embd))
  self:add('wpe', nn.Embedding(cfg.block_size, cfg.n_embd))
  local h = self:add('h', nn.ModuleList())
  for i = 1, cfg.n_layer do h:append(Block(cfg, i)) end
  self:add('ln_f', nn.LayerNorm(cfg.n_embd, { bias = cfg.bias }))
end

local GPT = nn.class('GPT2', nn.Module)
M.GPT = GPT
M.defaults = { vocab_size = 50304, block_size = 1024, n_layer = 12, n_head = 12, n_embd = 768,
               dropout = 0.0, bias = true, activation_checkpointing = false, pad_vocab_for_tp = 1,
               moe = false }

-- the config with its defaults filled in and its sizes checked
function M.resolve(cfg)
  cfg = common.fill(cfg, M.defaults, 'gpt2')
  common.check_config(cfg, 'gpt2')
  -- pad_vocab_for_tp (the trainer's tp size): the embedding's rows padded to
  -- a multiple of it, which tp cuts evenly; the padded logits are cut off
  -- here and masked by tp's head, and checkpoints hold the vocab_size rows
  -- (gptlua.dist.tensor_parallel)
  local t = cfg.pad_vocab_for_tp
  if type(t) ~= 'number' or t < 1 or t ~= math.floor(t) then
    error(('gpt2: pad_vocab_for_tp must be a positive integer, got %s'):format(tostring(t)), 3)
  end
  cfg.stored_vocab_size = cfg.vocab_size
  cfg.padded_vocab_size = math.ceil(cfg.vocab_size / t) * t
  cfg.moe = moe.model_config(cfg.moe, cfg.n_embd, 'gpt2')
  return cfg
end

function GPT:__init(cfg)
  cfg = M.resolve(cfg)
  self.config = cfg
  self:add('transformer', Transformer(cfg))
  self.lm_head_weight = self.transformer.wte.weight  -- tied
end

-- forward(idx (B,T) int, targets (B,T) int or nil) -> logits, loss
function GPT:forward(idx, targets, caches)
  local B, T = idx.shape[1], idx.shape[2]
  local cfg = self.config
  local start = caches and caches[1].pos or 0
  if start + T > cfg.block_size then
    error(('gpt2: sequence of %d tokens exceeds block_size %d'):format(start + T, cfg.block_size), 2)
  end
  local tr = self.transformer
  -- the position ids, made once per device and kept: an arange on a GPU
  -- copies from host memory, which a captured CUDA graph cannot replay
  local ids = rawget(self, 'position_ids')
  if not ids or ids.device ~= idx.device then
    ids = gl.arange(0, cfg.block_size, { device = idx.device }):keep()
    rawset(self, 'position_ids', ids)
  end
  -- a batch of prompts of different lengths (gptlua.infer) brings each row's positions (B, T)
  local pos = caches and caches.positions or ids:narrow(1, start + 1, T)
  local x = tr.wte(idx) + tr.wpe(pos)
  x = gl.dropout(x, cfg.dropout, self.training)
  for i = 1, tr.h.n do x = common.run_block(tr.h[i], x, caches and caches[i], cfg) end
  x = tr.ln_f(x)
  local w = self.lm_head_weight
  -- (a vocabulary-parallel head holds a shard of the padded rows and masks the padding itself)
  if cfg.padded_vocab_size ~= cfg.vocab_size and not self.tp_layout then w = w:narrow(1, 1, cfg.vocab_size) end
  return common.head(self, x, targets, gl.linear, w, 0)
end

-- training FLOPs per token; the position embedding is only looked up (the
-- token embedding also serves as the tied lm_head, so it counts)
function GPT:flops_per_token(T)
  return common.flops_per_token(self, self.transformer.wpe.weight, T) - 6 * moe.inactive_params(self)
end

function GPT:new_caches(B, S)
  local cfg = self.config
  return common.new_caches(cfg.n_layer, B, cfg.n_head, S, cfg.n_embd / cfg.n_head,
    self.transformer.wte.weight)
end
GPT.generate = common.generate
-- the head is the token embedding (optim.nanochat trains it at the head's rate)
GPT.ties_head_to_embedding = true
nn.checked(GPT, { __init = 'self:module, cfg:opts?',
                  forward = 'self:module, idx:ids, targets:ids?, caches:opts?',
                  generate = 'self:module, idx:ids, n:size, opts:opts?',
                  new_caches = 'self:module, batch:count, length:count' })

-- Loads GPT-2 weights from a model.safetensors in Hugging Face's layout
-- (Conv1D weights, names with or without "transformer."): gptlua.hf.
function GPT:load_gpt2_safetensors(path)
  return require('gptlua.hf').load_gpt2_weights(self, path)
end

return M
