-- gptlua.train_resume — what a resumed run compares and keeps: the model
-- keys a checkpoint must share with this run (mismatch: else it is not
-- loaded), what the run's command line gave and which schedule lengths
-- followed its max_iters (given, followed: saved in every checkpoint), and
-- the settings of a resume against the run's (resume_settings).  Methods of
-- gptlua.train's Trainer, installed there.
local train_config = require 'gptlua.train_config'

local M = {}

-- the first model key on which a checkpoint's config differs from this
-- run's, or nil when it describes this run's model
function M:mismatch(config)
  for _, k in ipairs({ 'model', 'n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size', 'depth' }) do
    if type(config) == 'table' and config[k] ~= nil and config[k] ~= self.cfg[k] then return k, config[k], self.cfg[k] end
  end
  if type(config) == 'table' and self.cfg.model == 'nanochat' then  -- the version and its features
    local k, theirs, ours = require('gptlua.models.nanochat').config_mismatch(config.nanochat, self.cfg.nanochat)
    if k then return 'nanochat.' .. k, theirs, ours end
  end
  -- the optimizer decides the state that is loaded: another one's is refused
  if type(config) == 'table' and config.optimizer ~= nil and config.optimizer ~= self.cfg.optimizer then
    return 'optimizer', config.optimizer, self.cfg.optimizer
  end
  -- mixture-of-experts blocks decide the parameters (the router, the experts)
  if type(config) == 'table' then
    local theirs, ours = type(config.moe) == 'table' and config.moe or {}, self.cfg.moe or {}
    local on = (ours.experts or 0) > 0 or (theirs.experts or 0) > 0
    for _, k in ipairs({ 'experts', 'shared', 'every', 'hidden' }) do
      if on and (k == 'experts' or (ours.experts or 0) > 0) and theirs[k] ~= ours[k] then
        return 'moe.' .. k, theirs[k] or 0, ours[k] or 0
      end
    end
  end
  -- Muon's variant decides its state (NorMuon's second moment) and update;
  -- a checkpoint from before the key is classic
  if type(config) == 'table' and self.cfg.optimizer == 'nanochat' and config.optimizer == 'nanochat'
    and (config.muon_variant or 'classic') ~= self.cfg.muon_variant then
    return 'muon_variant', config.muon_variant or 'classic', self.cfg.muon_variant
  end
  return nil
end

-- keys that say how this process runs, not what the run is: not compared on resume
local NOT_COMPARED = { resume = true, overwrite = true, allow_changes = true, resume_keep_batch = true, replay = true,
                       replay_to = true, quiet = true }

-- the run's values of the keys its command line gave: what a resume keeps
function M:given()
  if self.given_keys then return self.given_keys end
  local out = {}
  for k, v in pairs(self.launch.cli or {}) do if type(v) ~= 'table' and not NOT_COMPARED[k] then out[k] = self.cfg[k] end end
  self.given_keys = out
  return out
end

-- the schedule lengths that followed the command line's max_iters (train_config), by key
function M:followed()
  if self.followed_keys then return self.followed_keys end
  local out = {}
  for _, k in ipairs(self.launch.scaled_keys or {}) do out[k] = self.cfg[k] end
  self.followed_keys = out
  return out
end

-- The run's settings against this process's (a resume).  What the run's
-- command line gave (max_iters, schedule lengths) stays unless given again,
-- and so do the schedule lengths that followed its max_iters; a max_iters
-- given anew stretches the run's schedule lengths that no command line set.
-- Every other difference is printed.  A max_iters given that differs from
-- the run's, or a different number of tokens per step (another world size,
-- batch or accumulation), changes what the run is and needs --allow_changes.
function M:resume_settings(st)
  local cfg, run = self.cfg, st.config
  if type(run) ~= 'table' then return end
  local cli = self.launch.cli or {}
  local notes, refuse, kept = {}, {}, {}
  local run_given, run_followed = st.given or {}, st.followed or {}
  local function keep(k, v)
    if cfg[k] ~= v then kept[#kept + 1] = ('%s %s'):format(k, tostring(v)); cfg[k] = v end
  end
  if cli.max_iters == nil and run_given.max_iters ~= nil then keep('max_iters', run_given.max_iters) end
  for _, k in ipairs(train_config.SCHEDULE_STEP_KEYS) do
    if cli[k] == nil then
      if run_given[k] ~= nil then keep(k, run_given[k])
      elseif cli.max_iters ~= nil and type(run[k]) == 'number' and type(run.max_iters) == 'number' then
        cfg[k] = train_config.scaled_steps(run[k], run.max_iters, cfg.max_iters)
        self:followed()[k] = cfg[k]
      elseif run_followed[k] ~= nil then
        keep(k, run_followed[k])
        self:followed()[k] = run_followed[k]
      end
    end
  end
  -- what this run keeps for its next resume: the run's command line, then this one's
  local given = self:given()
  for k, v in pairs(run_given) do if cli[k] == nil then given[k] = v end end
  if #kept > 0 then
    table.sort(kept)
    self:print(('resume: the run\'s own %s (given again, they change)'):format(table.concat(kept, ', ')))
  end
  if cli.max_iters ~= nil and type(run.max_iters) == 'number' and cfg.max_iters ~= run.max_iters then
    refuse[#refuse + 1] = ('max_iters %s -> %s'):format(run.max_iters, cfg.max_iters)
  end
  local function show(v) return type(v) == 'string' and ("'%s'"):format(v) or tostring(v) end
  local function compare(a, b, prefix)
    local keys = {}
    for k in pairs(a) do keys[#keys + 1] = k end
    for k in pairs(b) do if a[k] == nil then keys[#keys + 1] = k end end
    table.sort(keys)
    for _, k in ipairs(keys) do
      local name = prefix .. k
      if type(a[k]) == 'table' and type(b[k]) == 'table' then compare(a[k], b[k], name .. '.')
      elseif not NOT_COMPARED[name] and a[k] ~= b[k] and type(b[k]) ~= 'table' and type(a[k]) ~= 'table' then
        notes[#notes + 1] = ('%s %s -> %s'):format(name, show(a[k]), show(b[k]))
      end
    end
  end
  compare(run, cfg, '')
  local ranks = st.ranks
  if ranks and ranks ~= self.dp_size then notes[#notes + 1] = ('data-parallel ranks %d -> %d'):format(ranks, self.dp_size) end
  if cfg.resume_keep_batch and st.tokens_per_step and st.tokens_per_step ~= self.tokens_per_step then
    local per_accum = self.tokens_per_step / cfg.gradient_accumulation_steps
    if st.tokens_per_step % per_accum == 0 then  -- another number of ranks: the run's global batch kept
      self:print(('resume: gradient_accumulation_steps %d -> %d keeps the run\'s %d tokens per step on %d '
        .. 'data-parallel ranks'):format(cfg.gradient_accumulation_steps, st.tokens_per_step / per_accum, st.tokens_per_step, self.dp_size))
      cfg.gradient_accumulation_steps = st.tokens_per_step / per_accum
      self.tokens_per_step = st.tokens_per_step
    end
  end
  if st.tokens_per_step and st.tokens_per_step ~= self.tokens_per_step then
    local msg = ('tokens per step %d -> %d'):format(st.tokens_per_step, self.tokens_per_step)
    local per_accum = self.tokens_per_step / cfg.gradient_accumulation_steps
    if st.tokens_per_step % per_accum == 0 then
      msg = msg .. (' (--gradient_accumulation_steps=%d keeps %d)'):format(st.tokens_per_step / per_accum, st.tokens_per_step)
    end
    refuse[#refuse + 1] = msg
  end
  if #notes > 0 then self:print('resume: settings that differ from the run\'s: ' .. table.concat(notes, ', ')) end
  if #refuse > 0 and not cfg.allow_changes then
    error(('resume: this changes what the run is: %s; --allow_changes continues it so, or keep the run\'s values')
      :format(table.concat(refuse, ', ')), 0)
  end
  self.schedule = (self.hooks.lr_schedule or train_config.lr_schedule)(cfg)
  if self.hooks.momentum_schedule then self.momentum_schedule = self.hooks.momentum_schedule(cfg) end
end

return M
