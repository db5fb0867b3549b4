-- Supervised fine-tuning (gptlua.sft): a pretrained run's model learns to
-- answer in the chat template on conversations, loss on the assistant's
-- tokens only, several conversations packed into each row with document
-- masking.  The tokenizer gains the template's special tokens (the
-- embedding and head grow rows for them) and is saved in the run's
-- directory, where `gptlua chat` and `gptlua generate` find it.
--   gptlua recipes/sft.lua --init=runs/shakespeare [--conversations=data/sft_example.jsonl]
--     [--val_conversations=FILE] [--val_fraction=0.1] [any trainer key: --max_iters=200 --batch_size=4 ...]
--   gptlua recipes/sft.lua --hf=path/to/gpt2 [...]
-- --init: a run (its latest checkpoint), its checkpoints/ or a checkpoint;
-- --hf: a Hugging Face GPT-2 directory (config.json, model.safetensors, its
-- tokenizer), trained with the trainer's AdamW defaults (the run: NAME-sft
-- after the directory's name).
-- Without --val_conversations the last val_fraction of the conversations
-- (at least one) are held out for the validation loss.  The run is named
-- after the one it starts from (shakespeare-sft); its other settings are
-- that run's, except: max_iters 200, the learning rates --lr_frac (0.02,
-- nanochat's init_lr_frac) times the run's, decaying linearly to 0 over the
-- steps (nanochat's chat_sft), an eval every 50 steps over all held-out
-- rows, no samples, one process and no CUDA graph (each batch brings its
-- segment ids).
local gl = require 'gptlua'
local config = require 'gptlua.config'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local sft = require 'gptlua.sft'

local own = { init = '', hf = '', conversations = 'data/sft_example.jsonl', val_conversations = '', val_fraction = 0.1,
              lr_frac = 0.02 }
local rest, mine = {}, {}
for _, a in ipairs(arg) do
  if a == '--help' or a == '-h' then
    io.write('usage: gptlua recipes/sft.lua (--init=RUN | --hf=DIR) [--conversations=FILE.jsonl] [--val_conversations=FILE.jsonl] ',
      '[--val_fraction=0.1] [--lr_frac=0.02] [--key=value for the trainer]\n')
    return 0
  end
  local k = a:match('^%-%-([%w_]+)')
  if k and own[k] ~= nil then mine[#mine + 1] = a else rest[#rest + 1] = a end
end
local o = config.merge(own, config.parse_args(mine, own, { prefix = 'sft', hint = 'gptlua recipes/sft.lua --help' }))
if (o.init == '') == (o.hf == '') then
  error('sft: give --init=RUN (a run, its checkpoints/ or a checkpoint) or --hf=DIR (a Hugging Face GPT-2), one of them', 0)
end
if not (o.lr_frac > 0 and o.lr_frac <= 1) then error(('sft: --lr_frac must be in (0, 1], got %s'):format(o.lr_frac), 0) end
if not (o.val_fraction > 0 and o.val_fraction < 1) then
  error(('sft: --val_fraction must be in (0, 1), got %s'):format(o.val_fraction), 0)
end

-- the run to start from: its config (the trainer's keys), weights and tokenizer
local base, weights, tok0, path
if o.hf ~= '' then
  local hf = require 'gptlua.hf'
  local model0, hcfg = hf.load_gpt2(o.hf)
  tok0, weights, path = hf.load_tokenizer(o.hf), model0:state_dict(), o.hf
  base = { name = (o.hf:gsub('/+$', ''):match('([^/]+)$') or 'hf'), model = 'gpt2', n_layer = hcfg.n_layer,
           n_head = hcfg.n_head, n_embd = hcfg.n_embd, block_size = hcfg.block_size, bias = true, dropout = 0,
           batch_size = 4, eval_iters = train.defaults.eval_iters, optimizer = 'adamw' }
else
  local run, note = require('gptlua.runs').resolve(o.init, function(d) return ckpt.resolve('latest', d .. '/checkpoints') ~= nil end)
  if note then io.stderr:write('sft: ', note, '\n') end
  path = ckpt.resolve('latest', run .. '/checkpoints') or ckpt.resolve('latest', run)
  if not path and ckpt.exists(run .. '/state.json') then path = run end
  if not path then error(('sft: no checkpoint in %s (expected a run directory, its checkpoints/ or a checkpoint)'):format(run), 0) end
  local c = ckpt.load(path)
  base, weights = c.state.config, c.model
  if base.model == 'nanochat' and base.nanochat == nil then base.nanochat = { version = 'v1' } end
  -- its tokenizer (its data's, or the one a fine-tune saved)
  tok0 = require('gptlua.infer').load(path, { what = 'sft', device = 'cpu' }).tokenizer
end
local tok, added = sft.with_chat_tokens(tok0)

-- conversations, packed
local convs = sft.load_conversations(o.conversations)
local train_convs, val_convs = convs, nil
if o.val_conversations ~= '' then val_convs = sft.load_conversations(o.val_conversations)
else
  if #convs < 2 then error(('sft: %s holds %d conversation; hold-out needs at least 2 (or give --val_conversations)'):format(
    o.conversations, #convs), 0) end
  local k = math.max(1, math.floor(#convs * o.val_fraction))
  train_convs, val_convs = {}, {}
  for i, m in ipairs(convs) do
    if i <= #convs - k then train_convs[#train_convs + 1] = m else val_convs[#val_convs + 1] = m end
  end
end

local recipe = {}
for k, v in pairs(base) do recipe[k] = v end
local B = base.batch_size
recipe.name = base.name .. '-sft'
recipe.data, recipe.vocab_size = 'random', tok.vocab_size   -- (the rows come from build_data below)
recipe.resume, recipe.overwrite, recipe.replay, recipe.replay_to, recipe.eval_tasks = '', false, '', 0, ''
recipe.max_iters, recipe.warmup_iters, recipe.lr_decay_iters = 200, 0, 200
-- lr_frac of the base's rates, linearly to 0 at the last step
recipe.lr_schedule = function(cfg) return function(step) return o.lr_frac * (1 - step / cfg.max_iters) end end
recipe.eval_interval, recipe.log_interval, recipe.checkpoint_interval, recipe.sample_length = 50, 10, 0, 0
recipe.sample_interval, recipe.cuda_graph, recipe.activation_checkpointing = 0, 'off', false
recipe.dist, recipe.tp, recipe.dp, recipe.cp, recipe.pp, recipe.sp = 'none', 1, 0, 1, 1, false
recipe.total_batch_size, recipe.quiet = 0, false

local rows_of = {}
recipe.build_data = function(cfg)
  local T = cfg.block_size
  local tr, cut = sft.pack(train_convs, tok, T)
  local va, vcut = sft.pack(val_convs, tok, T)
  if cut + vcut > 0 then
    print(('sft: %d conversations are longer than block_size + 1 = %d tokens and were cut'):format(cut + vcut, T + 1))
  end
  rows_of.train, rows_of.val = #tr, #va
  -- every held-out row once per eval, unless eval_iters was given
  if cfg.eval_iters == base.eval_iters then cfg.eval_iters = math.ceil(#va / cfg.batch_size) end
  local function L(rows, seed) return sft.loader(rows, { batch_size = cfg.batch_size, device = cfg.device, seed = seed }) end
  return { train = L(tr, cfg.seed), val = L(va, cfg.seed + 1), eval_train = L(tr, cfg.seed + 2), tokenizer = tok,
           vocab_size = tok.vocab_size }
end
recipe.build_model = function(cfg)
  local model = train.build_model(cfg)
  model:load_state_dict(sft.grow_state(model, weights))
  return sft.mask_documents(model)
end

local t = train.new(recipe, rest)
if t.cfg.cuda_graph ~= 'off' and t.cfg.cuda_graph ~= false then
  error('sft: a CUDA graph would replay the first batch\'s segment ids; leave cuda_graph off', 0)
end
if t.cfg.activation_checkpointing then
  error('sft: activation_checkpointing recomputes blocks outside the batch\'s segment ids; leave it off', 0)
end
t:open_run()
tok:save(t.run_dir .. '/tokenizer')
t:print(('sft: from %s; %d conversations packed into %d rows of %d (%d held out: %d rows)%s; tokenizer saved in %s/tokenizer'):format(
  path, #train_convs, rows_of.train, t.cfg.block_size, #val_convs, rows_of.val,
  #added > 0 and (', the tokenizer gained ' .. table.concat(added, ' ')) or '', t.run_dir))
t:run()
return 0
