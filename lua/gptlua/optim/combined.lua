-- gptlua.optim.combined — several optimizers stepped as one (Combined), and
-- nanochat's split of a model's parameters into named Muon and AdamW groups.
local gl = require 'gptlua'
local check = require 'gptlua.check'
local AdamW = require('gptlua.optim.adamw').AdamW
local M = require 'gptlua.optim.muon'
local Muon, MUON_VARIANTS = M.Muon, M.MUON_VARIANTS

local optim = {}

-- ------------------------------------------------------- combined optimizer
local Combined = {}
Combined.__index = Combined
optim.Combined = Combined
setmetatable(Combined, { __call = function(_, list)
  local groups = {}
  for _, o in ipairs(list) do for _, g in ipairs(o.groups) do groups[#groups + 1] = g end end
  return setmetatable({ optimizers = list, groups = groups }, Combined)
end })
function Combined:step() for _, o in ipairs(self.optimizers) do o:step() end end
function Combined:set_lr_mult(m) for _, o in ipairs(self.optimizers) do o:set_lr_mult(m) end end
-- the step block (AdamW:reserve_block ...): every member must take it
function Combined:takes_block()
  for _, o in ipairs(self.optimizers) do if not optim.takes_block(o) then return false end end
  return true
end
function Combined:reserve_block(block) for _, o in ipairs(self.optimizers) do o:reserve_block(block) end end
function Combined:write_block(b) for _, o in ipairs(self.optimizers) do o:write_block(b) end end
function Combined:step_block(block) for _, o in ipairs(self.optimizers) do o:step_block(block) end end
function Combined:step_taken() for _, o in ipairs(self.optimizers) do o:step_taken() end end
function Combined:state_dict()
  local out = { steps = {}, tensors = {} }
  for i, o in ipairs(self.optimizers) do
    local sd = o:state_dict()
    out.steps[i] = sd.step
    for k, t in pairs(sd.tensors) do out.tensors[k] = t end
  end
  return out
end
function Combined:load_state_dict(sd)
  for i, o in ipairs(self.optimizers) do o:load_state_dict({ step = sd.steps[i], tensors = sd.tensors }) end
end
function Combined:set_momentum(mu)
  for _, o in ipairs(self.optimizers) do
    if getmetatable(o) == Muon then for _, g in ipairs(o.groups) do g.momentum = mu end end
  end
end
-- Muon's weight decay times mult (a schedule's value: nanochat decays it
-- to zero over the run, optim.schedules.cosine_to_zero)
function Combined:set_muon_weight_decay_mult(mult)
  for _, o in ipairs(self.optimizers) do
    if getmetatable(o) == Muon then for _, g in ipairs(o.groups) do g.weight_decay = g.initial_weight_decay * mult end end
  end
end

-- nanochat's split: hidden matrices -> Muon, everything else -> AdamW.
-- variant 'classic' (gptlua's first release): embedding, head and any other
-- parameters in three AdamW groups, betas (0.8, 0.95), no weight decay,
-- rates scaled by (n_embd/768)^-0.5, the other group at scalar_lr 0.004.
-- variant 'current' (nanochat 92d63d4, GPT.setup_optimizer): AdamW eps
-- 1e-10 in nanochat's groups, s = (n_embd/768)^-0.5:
--   lm_head            unembedding_lr s      betas (0.8, 0.96)   wd 0.01
--   wte                embedding_lr s        (0.8, 0.995)        0.001
--   value_embeds.*     embedding_lr s / 2    (0.8, 0.995)        0.01
--   resid_lambdas      scalar_lr / 100       (0.8, 0.95)         0.05
--   x0_lambdas         scalar_lr             (0.96, 0.95)        0
--   the rest (smear gate and lambda, backout lambda)  0.2  (0.8, 0.95)  0
-- and Muon variant 'current' (NorMuon beta2 0.9, cautious weight decay
-- muon_weight_decay, default 0 as setup_optimizer's).  Groups a model
-- lacks are left out.
local NANOCHAT_CURRENT_GROUPS = {   -- name pattern, lr (a function of opts, s), betas, weight decay, group name, lr key
  { '^lm_head%.', function(o, s) return o.unembedding_lr * s end, { 0.8, 0.96 }, 0.01, 'unembedding', 'unembedding_lr' },
  { '^transformer%.wte%.', function(o, s) return o.embedding_lr * s end, { 0.8, 0.995 }, 0.001, 'embedding', 'embedding_lr' },
  { '^value_embeds%.', function(o, s) return o.embedding_lr * s * 0.5 end, { 0.8, 0.995 }, 0.01, 'value_embeds', 'embedding_lr' },
  { '^resid_lambdas$', function(o) return o.scalar_lr * 0.01 end, { 0.8, 0.95 }, 0.05, 'resid_lambdas', 'scalar_lr' },
  { '^x0_lambdas$', function(o) return o.scalar_lr end, { 0.96, 0.95 }, 0.0, 'x0_lambdas', 'scalar_lr' },
  { '', function() return 0.2 end, { 0.8, 0.95 }, 0.0, 'other' },
}
-- Every group is named (g.name); a group whose rate is a config key's
-- value times a factor carries both (g.lr_key, g.lr_factor), so that the
-- trainer logs rates by name and set{} moves exactly that key's groups.
local UNIT_RATES = { unembedding_lr = 1, embedding_lr = 1, scalar_lr = 1 }
local named_matrices

-- A rank may hold none of a member's parameters (a pipeline stage of block
-- matrices only has no AdamW parameter; one of embeddings only, no Muon
-- matrix): the member still exists, with one empty group, so that every
-- rank's optim.Combined lists AdamW then Muon, and a checkpoint's steps[i]
-- names the same member on any layout.
local function or_empty(list, empty_group)
  if #list > 0 then return list end
  empty_group.params = {}
  return { empty_group }
end

-- split: the non-matrix parameters as optim.nanochat sorted them {head, emb, other}
local function nanochat_current(opts, matrices, split, scale)
  local o = { unembedding_lr = opts.unembedding_lr or 0.008, embedding_lr = opts.embedding_lr or 0.3,
              scalar_lr = opts.scalar_lr or 0.5 }
  local members = {}
  for i = 1, #NANOCHAT_CURRENT_GROUPS do members[i] = {} end
  for _, np in ipairs(split.head) do table.insert(members[1], np) end  -- (a tied embedding's name is wte's)
  for _, list in ipairs({ split.emb, split.other }) do
    for _, np in ipairs(list) do
      for i, spec in ipairs(NANOCHAT_CURRENT_GROUPS) do
        if np[1]:match(spec[1]) then table.insert(members[i], np); break end
      end
    end
  end
  local groups = {}
  for i, spec in ipairs(NANOCHAT_CURRENT_GROUPS) do
    if #members[i] > 0 then
      groups[#groups + 1] = { params = members[i], lr = spec[2](o, scale), betas = spec[3], weight_decay = spec[4],
                              name = spec[5], lr_key = spec[6], lr_factor = spec[6] and spec[2](UNIT_RATES, scale) }
    end
  end
  return named_matrices(Combined({ AdamW(or_empty(groups, { lr = 0.2, name = 'other' }), { eps = 1e-10 }),
    Muon(or_empty(matrices, {}), { lr = opts.matrix_lr or 0.02, momentum = opts.momentum or 0.95,
      variant = 'current', normuon_beta2 = opts.muon_beta2, weight_decay = opts.muon_weight_decay }) }))
end

-- Muon's groups: 'matrix', at matrix_lr
function named_matrices(c)
  for _, o in ipairs(c.optimizers) do
    if getmetatable(o) == Muon then
      for _, g in ipairs(o.groups) do g.name, g.lr_key, g.lr_factor = 'matrix', 'matrix_lr', 1 end
    end
  end
  return c
end

function optim.nanochat(model, opts)
  opts = opts or {}
  local C = model.config.n_embd
  local scale = (C / 768) ^ -0.5
  local variant = opts.variant or 'classic'
  if not MUON_VARIANTS[variant] then check.fail('nanochat', 'variant', "'classic' or 'current'", variant, 3) end
  -- a model whose head is its token embedding (gpt2: ties_head_to_embedding)
  -- trains that matrix as the head: the embedding's rate, tuned for rows
  -- that one token's gradient reaches, diverges on the head's dense gradient
  local tied = model.ties_head_to_embedding
  local matrices, emb, head, other = {}, {}, {}, {}
  for _, np in ipairs(model:named_parameters()) do
    local name, p = np[1], np[2]
    if name:match('^transformer%.h%.') and #p.shape == 2 then matrices[#matrices + 1] = np
    elseif tied and name:match('^transformer%.wte%.') then head[#head + 1] = np
    elseif name:match('wte') then emb[#emb + 1] = np
    elseif name:match('lm_head') then head[#head + 1] = np
    else other[#other + 1] = np end
  end
  if variant == 'current' then
    return nanochat_current(opts, matrices, { head = head, emb = emb, other = other }, scale)
  end
  local adam_groups = {}
  if #emb > 0 then adam_groups[#adam_groups + 1] = { params = emb, lr = (opts.embedding_lr or 0.2) * scale,
    name = 'embedding', lr_key = 'embedding_lr', lr_factor = scale } end
  if #head > 0 then adam_groups[#adam_groups + 1] = { params = head, lr = (opts.unembedding_lr or 0.004) * scale,
    name = 'unembedding', lr_key = 'unembedding_lr', lr_factor = scale } end
  if #other > 0 then adam_groups[#adam_groups + 1] = { params = other, lr = (opts.scalar_lr or 0.004) * scale,
    name = 'scalar', lr_key = 'scalar_lr', lr_factor = scale } end
  local empty = { lr = (opts.embedding_lr or 0.2) * scale, name = 'embedding', lr_key = 'embedding_lr', lr_factor = scale }
  return named_matrices(Combined({
    AdamW(or_empty(adam_groups, empty), { betas = opts.adam_betas or { 0.8, 0.95 }, eps = 1e-10, weight_decay = 0 }),
    Muon(or_empty(matrices, {}), { lr = opts.matrix_lr or 0.02, momentum = opts.momentum or 0.95,
      weight_decay = opts.muon_weight_decay }) }))
end

-- whether optimizer o runs its step from a step block (gptlua.step_block)
function optim.takes_block(o)
  if o.takes_block then return o:takes_block() end
  return o.step_block ~= nil
end

return { Combined = Combined, optim = optim }
