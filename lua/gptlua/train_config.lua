-- gptlua.train_config — what a run is made of: every key a recipe may set
-- (defaults, integer ranges), the hooks a recipe may define (their results
-- checked), resolving a recipe plus command line into a checked cfg, and the
-- default builders of data, model, optimizer and learning-rate schedule.
-- gptlua.train re-exports each (train.defaults, train.build_model, ...).
local gl = require 'gptlua'
local config = require 'gptlua.config'
local check = require 'gptlua.check'
local optim = require 'gptlua.optim'
local ckpt = require 'gptlua.checkpoint'

local M = {}

-- Every key a recipe may set; nanoGPT's names where one exists.
M.defaults = {
  name = 'run', out_dir = 'runs', seed = 1337, device = 'auto', dtype = 'auto', threads = 0,
  -- model
  model = 'gpt2', vocab_size = 0, block_size = 64, n_layer = 4, n_head = 4, n_embd = 128, dropout = 0.0,
  bias = true, depth = 0, n_kv_head = 0, softcap = 15, activation_checkpointing = false,
  -- FP8 products for the blocks' linear layers (gptlua.fp8): 'off', 'tensorwise' or 'rowwise'
  fp8 = 'off', fp8_emulate = false,
  -- data: 'char' (character-level over data_path), 'random' (benchmarking), 'shards' (data_dir)
  data = 'char', data_path = 'data/tinyshakespeare.txt', data_dir = '', tokenizer = '', val_fraction = 0.1,
  shard_format = 'auto',
  sampling = 'random',
  -- batch
  batch_size = 12, gradient_accumulation_steps = 1, total_batch_size = 0,
  -- optimizer: 'adamw' or 'nanochat' (Muon for hidden matrices + AdamW)
  optimizer = 'adamw', learning_rate = 1e-3, min_lr = 1e-4, beta1 = 0.9, beta2 = 0.99, eps = 1e-8,
  weight_decay = 0.1, grad_clip = 1.0, matrix_lr = 0.02, embedding_lr = 0.2, unembedding_lr = 0.004, final_lr_frac = 0.1,
  -- nanochat's optimizer version (gptlua.optim.nanochat, optim.MUON_VARIANTS): 'classic' or 'current'
  muon_variant = 'classic', muon_weight_decay = 0, muon_weight_decay_schedule = 'constant', muon_beta2 = 0.9,
  scalar_lr = 0,
  -- schedule: 'cosine' (warmup, decay to min_lr at lr_decay_iters), 'wsd', 'constant'
  schedule = 'cosine', decay_lr = true, warmup_iters = 100, lr_decay_iters = 2000, cooldown_frac = 0.2,
  -- loop
  max_iters = 2000, eval_interval = 250, eval_iters = 20, eval_only = false, log_interval = 10,
  -- multiple-choice tasks at every eval (gptlua.eval): comma-separated JSONL files
  eval_tasks = '', eval_fewshot = 0, eval_delimiter = ' ', eval_task_limit = 0,
  sample_interval = 0, sample_length = 500, sample_prompt = '\n', temperature = 0.8, top_k = 0,
  checkpoint_interval = 0, checkpoint_async = true, resume_keep_batch = false, straggler_threshold = 0.5,
  always_save_checkpoint = true, keep_last = 2, resume = '', overwrite = false,
  allow_changes = false,
  max_bad_steps = 5,
  peak_flops = 0, quiet = false,
  -- seeing a run (gptlua.observe): TensorBoard events next to metrics.jsonl; profile = 'N' or 'A:B' steps
  tensorboard = true, profile = '', profile_continue = false,
  -- CUDA graphs (gptlua.train_graph): 'auto' (where one applies), 'off' (false) or true; optimizer
  -- steps run op by op first
  cuda_graph = 'auto', cuda_graph_warmup = 1,
  -- distributed policy (gptlua.dist): 'none', 'ddp', 'zero1', 'zero2', 'fsdp', 'hsdp'; unset on
  -- several ranks it is ddp ('none' trains each rank alone and is refused by run there);
  -- dist_timeout: seconds a collective may take before every rank is aborted
  dist = 'none', bucket_mb = 25, shard_size = 0, dist_timeout = 600,
  -- slow links (localsgd, diloco, ps, ddp's PowerSGD hook): gptlua.dist.policies.{localsgd,diloco,ps,powersgd}
  sync_every = 8, outer_lr = 0.7, outer_momentum = 0.9, outer_dtype = 'float32', diloco_fragments = 1,
  powersgd_rank = 0, ps_servers = 1, max_staleness = 0,
  -- steering and journal (gptlua.control, gptlua.journal): the control socket `gptlua attach` talks to,
  -- run_dir/journal.jsonl, and a journal this run must match step by step (set by `gptlua replay`)
  control = true, journal = true, journal_hash_interval = 10, replay = '', replay_to = 0,
  -- device mesh (gptlua.dist.mesh): tensor parallel over tp ranks, data parallel (dist) over dp
  dp = 0, tp = 1, sp = false, cp = 1, cp_mode = 'ulysses',
  fsdp = { reshard_after_forward = true, prefetch = true, accumulate = 'sharded', reduce_dtype = 'float32',
           fp8_all_gather = true },
  -- model = 'nanochat': 'v1' (first release) or 'v2' (nanochat 92d63d4) and each feature (gptlua.models.nanochat)
  nanochat = require('gptlua.models.nanochat').trainer_defaults(),
  -- pipeline parallel (gptlua.dist.pipeline, policies/pp.lua): stages over pp ranks, the accumulation
  -- steps are the microbatches; schedule 'gpipe', '1f1b' or 'interleaved' (pp_virtual stages per rank)
  pp = 1, pp_schedule = '1f1b', pp_virtual = 1, pp_partition = 'params',
  -- mixture of experts (gptlua.moe): experts = 0 is none; the router is the moe_router hook's or gptlua.moe's
  moe = require('gptlua.moe').trainer_defaults(),
  -- expert parallelism (gptlua.dist.expert_parallel): the experts split over ep ranks of the dp group
  ep = 1,
}

-- Integer keys: {min, max}.  Sizes reach the engine as int32; counts of
-- steps stay exact in a Lua number up to 2^53.  0 means "none", "off" or
-- "infer" where a key allows it.
local INT32, COUNT = 2 ^ 31 - 1, 2 ^ 53
local INTEGER_KEYS = {
  batch_size = { 1, INT32 }, block_size = { 1, INT32 }, gradient_accumulation_steps = { 1, INT32 },
  max_iters = { 1, COUNT }, warmup_iters = { 0, COUNT }, lr_decay_iters = { 0, COUNT }, eval_interval = { 0, COUNT },
  eval_iters = { 0, COUNT }, eval_fewshot = { 0, INT32 }, eval_task_limit = { 0, INT32 }, log_interval = { 0, COUNT }, sample_interval = { 0, COUNT }, sample_length = { 0, INT32 },
  checkpoint_interval = { 0, COUNT }, keep_last = { 0, INT32 }, max_bad_steps = { 0, COUNT }, top_k = { 0, INT32 },
  threads = { 0, INT32 }, total_batch_size = { 0, COUNT }, cuda_graph_warmup = { 0, COUNT }, seed = { 0, COUNT }, vocab_size = { 0, INT32 },
  n_layer = { 0, INT32 }, n_head = { 0, INT32 }, n_embd = { 0, INT32 }, depth = { 0, INT32 }, n_kv_head = { 0, INT32 },
  shard_size = { 0, COUNT }, sync_every = { 1, COUNT }, diloco_fragments = { 1, INT32 }, powersgd_rank = { 0, INT32 },
  ps_servers = { 1, INT32 }, max_staleness = { 0, COUNT }, journal_hash_interval = { 0, COUNT }, replay_to = { 0, COUNT },
  dp = { 0, INT32 }, tp = { 1, INT32 }, cp = { 1, INT32 }, pp = { 1, INT32 }, pp_virtual = { 1, INT32 }, ep = { 1, INT32 },
}
M.INTEGER_KEYS = INTEGER_KEYS

-- The keys each built-in optimizer reads; the other one's are refused when
-- given on the command line or to set{} (a key that would change nothing).
-- adamw: learning_rate is the peak rate of every group, min_lr the cosine's
-- floor.  nanochat: each group has its own peak (matrix_lr for Muon's
-- hidden matrices, embedding_lr, unembedding_lr, scalar_lr for AdamW's) and
-- final_lr_frac is the cosine's floor as a fraction of each peak.
M.OPTIMIZER_KEYS = {
  adamw = { 'learning_rate', 'min_lr', 'beta1', 'beta2', 'eps', 'weight_decay' },
  nanochat = { 'matrix_lr', 'embedding_lr', 'unembedding_lr', 'scalar_lr', 'final_lr_frac', 'muon_variant',
               'muon_weight_decay', 'muon_weight_decay_schedule', 'muon_beta2' },
}
local KEY_OWNER = {}
for opt, keys in pairs(M.OPTIMIZER_KEYS) do for _, k in ipairs(keys) do KEY_OWNER[k] = opt end end

-- nil, or why the run's optimizer ignores key, its names written with
-- dashes ('--' on the command line, '' for set{}); a recipe with its own
-- build_optimizer reads what it likes: nothing is refused then
function M.ignored_key(cfg, hooks, key, dashes)
  local owner = KEY_OWNER[key]
  if not owner or owner == cfg.optimizer or (hooks and hooks.build_optimizer) then return nil end
  if not M.OPTIMIZER_KEYS[cfg.optimizer] then return nil end
  local d = dashes or ''
  local rates = cfg.optimizer == 'nanochat'
    and ('its rates: %smatrix_lr, %sembedding_lr, %sunembedding_lr, %sscalar_lr; its floor: %sfinal_lr_frac')
      :format(d, d, d, d, d)
    or ('its rate: %slearning_rate; its floor: %smin_lr'):format(d, d)
  return ("%s%s is a key of optimizer '%s'; this run's optimizer '%s' ignores it (%s)"):format(d, key, owner,
    cfg.optimizer, rates)
end

-- Step counts that follow max_iters: one not set on the command line keeps
-- its proportion to the max_iters of the recipe (or of the run resumed)
-- when the command line changes max_iters.
M.SCHEDULE_STEP_KEYS = { 'warmup_iters', 'lr_decay_iters', 'eval_interval' }
function M.scaled_steps(v, from, to)
  if v == 0 or from == to then return v end
  if v == from then return to end
  return math.max(1, math.floor(v * to / from + 0.5))
end

-- the scalar group's rate that scalar_lr = 0 stands for (optim.nanochat's per variant)
M.SCALAR_LR = { classic = 0.004, current = 0.5 }

-- Real keys with a range: {min, max, max_open}; a value outside it would
-- fail later inside an op (a negative val_fraction as a narrow of negative
-- length) instead of naming the key.
local REAL_KEYS = {
  val_fraction = { 0, 1, true }, cooldown_frac = { 0, 1 }, dropout = { 0, 1, true }, beta1 = { 0, 1, true },
  beta2 = { 0, 1, true }, eps = { 0, math.huge }, temperature = { 0, math.huge }, straggler_threshold = { 0, math.huge },
}  -- (outer_lr and outer_momentum: DiLoCo checks its own, dist/policies/diloco.lua)
M.REAL_KEYS = REAL_KEYS

-- Hooks a recipe may define, each with what it must return: a hook that
-- returns something else fails at once, naming the hook and what it returned
-- (not later as "attempt to index a nil value").  false: anything.
local function has(fields)
  return function(v)
    if type(v) ~= 'table' then return false end
    for _, f in ipairs(fields) do if v[f] == nil then return false end end
    return true
  end
end
local function callable(v)
  local mt = type(v) == 'table' and getmetatable(v)
  return type(v) == 'function' or (mt and mt.__call ~= nil) or false
end
local HOOKS = {
  build_model = { 'a model (a table with forward and parameters)', has({ 'forward', 'parameters' }) },
  build_data = { 'a table with a train loader (a table with next_batch)',
                 function(v) return type(v) == 'table' and type(v.train) == 'table' and v.train.next_batch ~= nil end },
  build_optimizer = { 'an optimizer (a table with step)', has({ 'step' }) },
  lr_schedule = { 'a function of the step', callable },
  momentum_schedule = { 'a function of the step', callable },  -- Muon's momentum (default: optim.schedules.muon_momentum)
  param_groups = { 'a table of parameter groups', function(v) return type(v) == 'table' end },
  fsdp_units = { 'a table of units', function(v) return type(v) == 'table' end },
  pp_partition = { 'a list of block counts, one per pipeline stage', function(v) return type(v) == 'table' end },
  pp_schedule = { 'a pipeline schedule (gptlua.dist.schedules)',
                  function(v) return type(v) == 'table' and type(v.ranks) == 'table' end },
  moe_router = { 'a router (a table with route, losses and after_step, as gptlua.moe.router)',
                 has({ 'route', 'losses', 'after_step' }) },
  on_log = false, on_eval = false,
}

-- the recipe's hook `name` with its result checked
local function checked_hook(name, f)
  local want = HOOKS[name]
  if not want then return f end
  return function(...)
    local r = f(...)
    if not want[2](r) then
      error(('recipe: hook %s returned %s, expected %s'):format(name, check.describe(r), want[1]), 0)
    end
    return r
  end
end

M.checked_hook = checked_hook  -- gptlua.control's reload swaps hooks through it

-- splits a recipe table into config values and hook functions
local function split_recipe(recipe)
  if type(recipe) ~= 'table' then
    error(('recipe: expected a table of config values and hooks, got %s'):format(check.describe(recipe)), 0)
  end
  local cfg, hooks = {}, {}
  for k, v in pairs(recipe) do
    if type(v) == 'function' then
      if HOOKS[k] == nil then
        local names = {}
        for h in pairs(HOOKS) do names[#names + 1] = h end
        table.sort(names)
        error(('recipe: unknown hook %s (valid hooks: %s)'):format(k, table.concat(names, ', ')), 0)
      end
      hooks[k] = checked_hook(k, v)
    else cfg[k] = v end
  end
  return cfg, hooks
end

local function fail(msg) error('config: ' .. msg, 0) end

-- Returns cfg, hooks and where the launch put it: {ranks = the world the
-- launcher variables describe (1 without a launcher), dist_default = true
-- when dist was not set and the world made it ddp}.
-- dtype 'auto': bfloat16 mixed precision on a GPU (bf16 weights and
-- activations, fp32 master weights and optimizer state: optim.needs_master),
-- float32 on the CPU, where bf16 only adds conversions
function M.auto_dtype(device) return device == 'cpu' and 'float32' or 'bfloat16' end

-- the models and optimizers the default builders make (spec/composition_spec.lua
-- trains every one under every layout)
M.MODELS = { gpt2 = true, nanochat = true }
M.OPTIMIZERS = { adamw = true, nanochat = true }

function M.resolve_config(recipe, args)
  local rcfg, hooks = split_recipe(recipe)
  config.validate(rcfg, M.defaults)
  local cli = config.parse_args(args, M.defaults)
  local cfg = config.merge(M.defaults, rcfg, cli)
  -- the launcher's world (an error when its sources disagree): more than one
  -- rank trains with ddp unless the recipe or the command line says otherwise
  local launched = require('gptlua.dist').discover()
  local launch = { ranks = launched and launched.size or 1, cli = cli }
  if launch.ranks > 1 and rcfg.dist == nil and cli.dist == nil then
    cfg.dist, launch.dist_default = 'ddp', true
  end
  if cfg.device == 'auto' then cfg.device = gl.default_device() end
  if not pcall(gl.Tensor.device_id, cfg.device) then
    fail(("device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got '%s'%s"):format(check.printable(cfg.device),
      (cfg.device == 'gpu' or cfg.device == 'gpu:0') and ' (did you mean --device=cuda?)' or ''))
  end
  if cfg.device ~= 'cpu' and not gl.cuda_available() then
    fail(('device %s requested but no CUDA device is available (use --device=cpu)'):format(cfg.device))
  end
  for _, k in ipairs({ 'learning_rate', 'min_lr', 'weight_decay', 'grad_clip', 'matrix_lr', 'muon_weight_decay',
                       'scalar_lr' }) do
    if cfg[k] < 0 then fail(('%s must be >= 0, got %s'):format(k, cfg[k])) end
  end
  if type(cfg.name) ~= 'string' or not cfg.name:match('^[%w_][%w_.-]*$') then
    fail(('name must be a directory name of letters, digits, _ . - (not starting with . or -), got %s')
      :format(check.describe(cfg.name)))
  end
  if cfg.overwrite and cfg.resume ~= '' and cfg.resume ~= false then
    fail('resume and overwrite exclude each other: --resume continues the run, --overwrite deletes it')
  end
  if cfg.cp_mode ~= 'ulysses' and cfg.cp_mode ~= 'ring' then
    fail(("cp_mode expected 'ulysses' or 'ring', got %s"):format(check.printable(cfg.cp_mode)))
  end
  if not (cfg.dist_timeout > 0) then fail(('dist_timeout must be > 0 seconds, got %s'):format(cfg.dist_timeout)) end
  -- integer keys: the shared check refuses 2.5, NaN, inf and values past
  -- what the key's type holds (config.lua already refused non-finite numbers)
  local names = {}
  for k in pairs(INTEGER_KEYS) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local r = INTEGER_KEYS[k]
    check.integer(cfg[k], 'config', k, r[1], r[2], config.NO_POSITION)
  end
  if cli.max_iters ~= nil then   -- the recipe's schedule, stretched to the command line's max_iters
    local base = rcfg.max_iters or M.defaults.max_iters
    for _, k in ipairs(M.SCHEDULE_STEP_KEYS) do
      if cli[k] == nil and type(cfg[k]) == 'number' and type(base) == 'number' and type(cfg.max_iters) == 'number' then
        local v = M.scaled_steps(cfg[k], base, cfg.max_iters)
        if v ~= cfg[k] then
          launch.scaled, launch.scaled_keys = launch.scaled or {}, launch.scaled_keys or {}
          launch.scaled[#launch.scaled + 1] = ('%s %s (the recipe\'s %s)'):format(k, v, cfg[k])
          launch.scaled_keys[#launch.scaled_keys + 1] = k
          cfg[k] = v
        end
      end
    end
  end
  if cfg.powersgd_rank > 0 and cfg.dist ~= 'ddp' then
    fail(("powersgd_rank is a communication hook of dist = 'ddp', got dist = '%s'"):format(check.printable(cfg.dist)))
  end
  if not require('gptlua.dist.schedules').builders[cfg.pp_schedule] then
    fail(("unknown pp_schedule '%s' (expected 'gpipe', '1f1b', 'interleaved', 'zbh1' or 'zbh2')"):format(check.printable(cfg.pp_schedule)))
  end
  if cfg.pp_partition ~= 'params' and cfg.pp_partition ~= 'flops' then
    fail(("unknown pp_partition '%s' (expected 'params' or 'flops'; a recipe's pp_partition hook cuts by hand)")
      :format(check.printable(cfg.pp_partition)))
  end
  if cfg.eval_interval > 0 and cfg.eval_iters < 1 then
    fail(('eval_iters must be >= 1 when eval_interval is set (%d), got %d'):format(cfg.eval_interval, cfg.eval_iters))
  end
  -- the task files load now: a bad one is one line before anything trains
  for _, p in ipairs(require('gptlua.eval').task_paths(cfg.eval_tasks)) do require('gptlua.eval').load_task(p) end
  if not M.OPTIMIZERS[cfg.optimizer] and not hooks.build_optimizer then
    fail(("unknown optimizer '%s' (expected 'adamw' or 'nanochat')"):format(check.printable(cfg.optimizer)))
  end
  for _, k in ipairs(config.sorted_keys(cli)) do
    local why = M.ignored_key(cfg, hooks, k, '--')
    if why then fail(why) end
  end
  if not optim.MUON_VARIANTS[cfg.muon_variant] then
    fail(("unknown muon_variant '%s' (expected 'classic' or 'current')"):format(check.printable(cfg.muon_variant)))
  end
  if cfg.muon_weight_decay_schedule ~= 'constant' and cfg.muon_weight_decay_schedule ~= 'cosine' then
    fail(("unknown muon_weight_decay_schedule '%s' (expected 'constant' or 'cosine')"):format(
      check.printable(cfg.muon_weight_decay_schedule)))
  end
  if not (cfg.muon_beta2 >= 0 and cfg.muon_beta2 < 1) then fail(('muon_beta2 must be in [0, 1), got %s'):format(cfg.muon_beta2)) end
  if cfg.muon_variant ~= 'classic' and cfg.optimizer ~= 'nanochat' and not hooks.build_optimizer then
    fail(("muon_variant '%s' applies to optimizer = 'nanochat', got optimizer = '%s'"):format(cfg.muon_variant,
      check.printable(cfg.optimizer)))
  end
  if cfg.muon_variant ~= 'classic' and cfg.optimizer == 'nanochat' and cfg.tp > 1 then
    fail(("muon_variant '%s' with tp > 1 is not supported yet (tensor parallelism runs the classic Muon)")
      :format(cfg.muon_variant))
  end
  -- scalar_lr 0: the variant's rate, written into cfg so that the log, --help and set{} show the one in use
  if cfg.optimizer == 'nanochat' and cfg.scalar_lr == 0 then cfg.scalar_lr = M.SCALAR_LR[cfg.muon_variant] end
  if not (cfg.final_lr_frac >= 0 and cfg.final_lr_frac <= 1) then
    fail(('final_lr_frac must be in [0, 1], got %s'):format(cfg.final_lr_frac))
  end
  if not M.MODELS[cfg.model] and not hooks.build_model then
    fail(("unknown model '%s' (expected 'gpt2' or 'nanochat')"):format(check.printable(cfg.model)))
  end
  if cfg.schedule ~= 'cosine' and cfg.schedule ~= 'wsd' and cfg.schedule ~= 'constant' then
    fail(("unknown schedule '%s' (expected 'cosine', 'wsd' or 'constant')"):format(check.printable(cfg.schedule)))
  end
  if cfg.model == 'nanochat' then
    local ok, err = pcall(require('gptlua.models.nanochat').trainer_keys, cfg.nanochat)
    if not ok then fail(tostring(err)) end
  end
  do  -- mixture of experts: the keys, and ep's own rules
    local ok, mc = pcall(require('gptlua.moe').resolve, cfg.moe, cfg.n_embd)
    if not ok then fail(tostring(mc)) end
    if cfg.ep > 1 and cfg.dist == 'none' then
      fail(("ep %d needs a distributed run (dist = 'ddp' or 'fsdp')"):format(cfg.ep))
    end
    if cfg.ep > 1 and not mc then
      fail(('ep %d needs mixture-of-experts blocks (moe.experts > 0), got moe.experts 0'):format(cfg.ep))
    end
    if cfg.ep > 1 and mc.experts % cfg.ep ~= 0 then
      fail(('ep %d does not divide moe.experts %d (each ep rank holds moe.experts / ep experts)'):format(cfg.ep,
        mc.experts))
    end
  end
  if cfg.model == 'gpt2' and cfg.n_embd % cfg.n_head ~= 0 then
    fail(('n_embd %d is not divisible by n_head %d'):format(cfg.n_embd, cfg.n_head))
  end
  local reals = {}
  for k in pairs(REAL_KEYS) do reals[#reals + 1] = k end
  table.sort(reals)
  for _, k in ipairs(reals) do
    local r, v = REAL_KEYS[k], cfg[k]
    if v < r[1] or v > r[2] or (r[3] and v == r[2]) then
      fail(('%s must be in [%s, %s%s, got %s'):format(k, r[1], r[2] == math.huge and 'inf' or r[2],
        r[3] and ')' or ']', v))
    end
  end
  if cfg.dtype == 'auto' then cfg.dtype, launch.dtype_auto = M.auto_dtype(cfg.device), true end
  if cfg.dtype ~= 'float32' and cfg.dtype ~= 'float64' and cfg.dtype ~= 'bfloat16' then
    fail(("dtype must be auto, float32, float64 or bfloat16, got '%s'"):format(check.printable(cfg.dtype)))
  end
  if cfg.fp8 ~= 'off' and cfg.dtype == 'float64' then
    fail(("fp8 '%s' quantizes float32 or bfloat16 operands, got dtype float64"):format(check.printable(cfg.fp8)))
  end
  do  -- FP8 needs sm_89+, or --fp8_emulate on the CPU (gptlua.fp8)
    local major, minor
    if cfg.fp8 ~= 'off' and cfg.device ~= 'cpu' then
      local p = require('gptlua.cuda').get_device_properties(cfg.device)
      major, minor = p.major, p.minor
    end
    local why = require('gptlua.fp8').refusal(cfg, major, minor)
    if why then fail(why) end
  end
  return cfg, hooks, launch
end

-- ------------------------------------------------------------------ data
-- the path a key names, as given or under gl.root; kind 'file' (a regular
-- file) or 'directory'
local function is_dir(p) return ckpt.exists(p .. '/.') end
local function resolve_path(p, key, kind)
  local alt = gl.root .. '/' .. p
  local found = ckpt.exists(p) and p or (p:sub(1, 1) ~= '/' and ckpt.exists(alt) and alt) or nil
  if not found then
    fail(('%s %s not found (expected a %s%s)'):format(key, p, kind,
      p:sub(1, 1) ~= '/' and ', also looked in ' .. gl.root or ''))
  end
  if (kind == 'directory') ~= is_dir(found) then
    fail(('%s %s is a %s, expected a %s'):format(key, found, is_dir(found) and 'directory' or 'file', kind))
  end
  return found
end

-- f(...), its error about the user's data (a shard, a token past the
-- vocabulary) as the one line of a user error, without the library's position
local function user_data(f, ...)
  local ok, r = pcall(f, ...)
  if not ok then error((tostring(r):gsub('^[^\n]-:%d+: ', '')), 0) end
  return r
end

-- The tokenizer and vocabulary of the shards in dir: --tokenizer, else the
-- one recipes/prepare.lua saved beside them (dir/tokenizer, or
-- dir/tokenizer.tiktoken), else the shards' own: the vocab_size their
-- gptlua headers name, or for llm.c and nanoGPT files, which name none,
-- the largest id + 1 rounded up to a multiple of VOCAB_ROUND (as llm.c pads
-- GPT-2's 50257 to 50304).  Returns tok (or nil), vocab_size and a line
-- saying where the vocabulary came from when no tokenizer gave it.
local VOCAB_ROUND = 128
M.VOCAB_ROUND = VOCAB_ROUND
function M.shards_vocabulary(cfg, dir)
  local tokenizer, data = require 'gptlua.tokenizer', require 'gptlua.data'
  if cfg.tokenizer ~= '' then
    local tok = user_data(tokenizer.load, resolve_path(cfg.tokenizer, 'tokenizer', 'file'))
    return tok, tok.vocab_size
  end
  for _, name in ipairs({ 'tokenizer', 'tokenizer.tiktoken' }) do
    if ckpt.exists(dir .. '/' .. name) and not is_dir(dir .. '/' .. name) then
      local tok = user_data(tokenizer.load, dir .. '/' .. name)
      return tok, tok.vocab_size, ('data: vocab_size %d from the tokenizer beside the shards, %s/%s')
        :format(tok.vocab_size, dir, name)
    end
  end
  local files = data.list_shards(dir, 'train')
  for _, f in ipairs(data.list_shards(dir, 'val')) do files[#files + 1] = f end
  if #files == 0 then
    fail(('data_dir %s has no shards (expected .bin files such as train_000000.bin, name_val.bin, train.bin)'):format(dir))
  end
  local v = user_data(data.shards_vocab, files, cfg.shard_format)
  if v.max_id < 0 then
    return nil, v.vocab_size, ('data: vocab_size %d from the shards\' headers (no tokenizer: --tokenizer names one)')
      :format(v.vocab_size)
  end
  local V = math.max(v.vocab_size, math.ceil((v.max_id + 1) / VOCAB_ROUND) * VOCAB_ROUND)
  return nil, V, ('data: vocab_size %d from the shards: their largest token is %d, rounded up to a multiple of %d '
    .. '(no tokenizer: --tokenizer or --vocab_size sets it)'):format(V, v.max_id, VOCAB_ROUND)
end

-- default data: returns {train = loader, val = loader, tokenizer = tok, vocab_size = n}
function M.build_data(cfg, rank, world)
  local data = require 'gptlua.data'
  local function loaders(train_tokens, val_tokens)
    -- (a vocab_size set by hand is the model's: the loader checks the ids against it)
    local common = { batch_size = cfg.batch_size, block_size = cfg.block_size, rank = rank, world_size = world,
                     sampling = cfg.sampling, device = cfg.device, vocab_size = cfg.vocab_size > 0 and cfg.vocab_size or nil }
    local function mk(tokens, seed)
      if tokens:numel() <= cfg.block_size + 1 then
        fail(('block_size %d is longer than the data (%d tokens in a split)'):format(cfg.block_size, tokens:numel()))
      end
      local o = {}
      for k, v in pairs(common) do o[k] = v end
      o.tokens, o.seed = tokens, seed
      return user_data(data.loader, o)
    end
    -- eval reads the training split through its own stream so that
    -- evaluating never moves the training data position
    return mk(train_tokens, cfg.seed), mk(val_tokens, cfg.seed + 1), mk(train_tokens, cfg.seed + 2)
  end
  if cfg.data == 'char' then
    local tokenizer = require 'gptlua.tokenizer'
    local text = require('gptlua.util').read_file(resolve_path(cfg.data_path, 'data_path', 'file'), 'config: data_path')
    local tok = tokenizer.char(text)
    local ids = tok:encode(text, { tensor = true })
    local n = ids:numel()
    local n_train = math.floor(n * (1 - cfg.val_fraction))
    local val_tokens = ids:narrow(1, n_train + 1, n - n_train):contiguous():keep()
    local tr, va, ev = loaders(ids:narrow(1, 1, n_train):contiguous(), val_tokens)
    return { train = tr, val = va, eval_train = ev, tokenizer = tok, vocab_size = tok.vocab_size,
             val_tokens = val_tokens }
  elseif cfg.data == 'random' then
    -- uniform random tokens generated by the loader itself (benchmarking)
    local V = cfg.vocab_size > 0 and cfg.vocab_size or 50304
    local function mk(seed)
      return data.loader({ source = 'random', vocab_size = V, batch_size = cfg.batch_size, block_size = cfg.block_size,
                           rank = rank, world_size = world, seed = seed, device = cfg.device })
    end
    return { train = mk(cfg.seed), val = mk(cfg.seed + 1), eval_train = mk(cfg.seed + 2), vocab_size = V }
  elseif cfg.data == 'shards' then
    if cfg.data_dir == '' then fail("data = 'shards' needs data_dir") end
    local dir = resolve_path(cfg.data_dir, 'data_dir', 'directory')
    local tok, V, note = M.shards_vocabulary(cfg, dir)
    -- the loaders check every token of every shard against the model's
    -- vocabulary (an id past it would index outside the embedding)
    local model_vocab = cfg.vocab_size > 0 and cfg.vocab_size or V
    local common = { batch_size = cfg.batch_size, block_size = cfg.block_size, rank = rank, world_size = world,
                     sampling = cfg.sampling, device = cfg.device, bos_aligned = false, shard_format = cfg.shard_format,
                     vocab_size = model_vocab }
    local function mk(split, seed)
      local o = {}
      for k, v in pairs(common) do o[k] = v end
      o.files, o.seed, o.split = dir, seed, split
      return user_data(data.loader, o)
    end
    return { train = mk('train', cfg.seed), val = mk('val', cfg.seed + 1), eval_train = mk('train', cfg.seed + 2), tokenizer = tok,
             vocab_size = V, vocab_note = note }
  end
  fail(("unknown data source '%s' (expected 'char', 'random' or 'shards')"):format(check.printable(cfg.data)))
end

-- ------------------------------------------------------------------ model
-- the model's constructor config from the trainer's
-- (under tp the vocabulary is padded to a multiple of tp, as Megatron-LM's
-- make_vocab_size_divisible_by: the models' pad_vocab_for_tp)
local function model_args(cfg)
  local tp_pad = cfg.tp > 1 and cfg.tp or nil
  if cfg.model == 'gpt2' then
    return { vocab_size = cfg.vocab_size, block_size = cfg.block_size, n_layer = cfg.n_layer, n_head = cfg.n_head,
             n_embd = cfg.n_embd, dropout = cfg.dropout, bias = cfg.bias,
             activation_checkpointing = cfg.activation_checkpointing, pad_vocab_for_tp = tp_pad, moe = cfg.moe }
  end
  local mc = { vocab_size = cfg.vocab_size, block_size = cfg.block_size, softcap = cfg.softcap,
               dropout = cfg.dropout, activation_checkpointing = cfg.activation_checkpointing }
  if cfg.depth > 0 then mc.depth = cfg.depth
  else mc.n_layer, mc.n_head, mc.n_embd, mc.depth = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_layer end
  if cfg.n_kv_head > 0 then mc.n_kv_head = cfg.n_kv_head end
  for k, v in pairs(require('gptlua.models.nanochat').trainer_keys(cfg.nanochat)) do mc[k] = v end
  mc.pad_vocab_for_tp = tp_pad
  mc.moe = cfg.moe
  return mc
end

-- the default model's resolved sizes, without building it (what
-- gptlua.dist.compose checks a layout against); nil for a recipe's own model
function M.model_config(cfg, hooks)
  if hooks and hooks.build_model then return nil end
  if cfg.model == 'gpt2' then return require('gptlua.models.gpt2').resolve(model_args(cfg)) end
  return require('gptlua.models.nanochat').resolve(model_args(cfg))
end

function M.build_model(cfg)
  if cfg.model == 'gpt2' then return require('gptlua.models.gpt2').GPT(model_args(cfg)) end
  return require('gptlua.models.nanochat').GPT(model_args(cfg))
end

-- AdamW with weight decay on matrices only (nanoGPT), or nanochat's split
function M.build_optimizer(cfg, model, groups)
  if cfg.optimizer == 'nanochat' then
    return optim.nanochat(model, { matrix_lr = cfg.matrix_lr, embedding_lr = cfg.embedding_lr,
                                   unembedding_lr = cfg.unembedding_lr, variant = cfg.muon_variant,
                                   muon_weight_decay = cfg.muon_weight_decay, muon_beta2 = cfg.muon_beta2,
                                   scalar_lr = cfg.scalar_lr > 0 and cfg.scalar_lr or nil })
  end
  local own_lr = {}   -- groups without their own lr run at learning_rate (set{} moves them with it)
  if groups then for i, g in ipairs(groups) do own_lr[i] = type(g) == 'table' and g.lr ~= nil end end
  if not groups then
    local decay, no_decay = {}, {}
    for _, np in ipairs(model:named_parameters()) do
      if #np[2].shape >= 2 then decay[#decay + 1] = np else no_decay[#no_decay + 1] = np end
    end
    groups = { { params = decay, weight_decay = cfg.weight_decay, name = 'decay' } }
    if #no_decay > 0 then groups[2] = { params = no_decay, weight_decay = 0, name = 'no_decay' } end
  end
  local o = optim.AdamW(groups, { lr = cfg.learning_rate, betas = { cfg.beta1, cfg.beta2 }, eps = cfg.eps })
  for i, g in ipairs(o.groups) do
    if not own_lr[i] then g.lr_key, g.lr_factor = 'learning_rate', 1 end
  end
  return o
end

-- The optimizer's current rates by group name, in group order: a list of
-- {name, lr}, one per name (the first group of that name); one entry named
-- 'lr' when every group runs at the same rate.
function M.group_rates(optimizer)
  local out, seen, same = {}, {}, true
  for i, g in ipairs(optimizer.groups or {}) do
    local name = g.name or ('group' .. i)
    if not seen[name] then seen[name] = true; out[#out + 1] = { name, g.lr } end
    if g.lr ~= optimizer.groups[1].lr then same = false end
  end
  if same and #out > 0 then return { { 'lr', out[1][2] } } end
  return out
end

function M.lr_schedule(cfg)
  if not cfg.decay_lr or cfg.schedule == 'constant' then return optim.schedules.linear_warmup(cfg.warmup_iters) end
  if cfg.schedule == 'wsd' then return optim.schedules.wsd(cfg.warmup_iters, cfg.max_iters, cfg.cooldown_frac, 0) end
  local ratio = cfg.learning_rate > 0 and cfg.min_lr / cfg.learning_rate or 0
  if cfg.optimizer == 'nanochat' then ratio = cfg.final_lr_frac end
  return optim.schedules.cosine(cfg.warmup_iters, cfg.lr_decay_iters, ratio)
end


return M
