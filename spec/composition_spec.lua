-- Every parallel layout with every data-parallel policy, optimizer and
-- model: each cell of the product either trains equal to one process at the
-- same global batch (every step's loss and clipped gradient norm, the
-- parameters after the last step) or is refused in one line before
-- anything is built (gptlua.dist.compose, through train.refusal: the check
-- every rank of a job makes first).
--
-- The lists come from the code where it has them: the policies from
-- gptlua.dist.POLICIES, the models from train.MODELS (nanochat once per
-- version of gptlua.models.nanochat), the optimizers from train.OPTIMIZERS;
-- the layouts are listed here (plain, tp, tp + sp, cp Ulysses and ring, pp
-- 2 and 4 with 1F1B and ZB-H1, their pairs and pp x tp x dp, expert
-- parallelism alone and with tp and pp, on models with MoE blocks, and FP8
-- products plain and with tp, tp + sp, cp and pp).  A policy
-- that compose.MESH_POLICIES does not list (localsgd, diloco, ps: their
-- ranks' parameters differ from one process's by design) must be refused
-- under every layout with tp, cp, pp or ep; on the plain layout their own specs
-- cover them.
--
-- Refusals cost nothing to ask, so every cell of the product is asked, and
-- each refusal must be one line with no position in it and one of the
-- refusals listed in REFUSED below (a new one fails here until it is
-- listed, or fixed).  Training costs a launch: the cells that train are
-- covered by a subset run in one launch per world size (spec/support/
-- dist_train.lua): per layout, every model x optimizer pair and every policy
-- at least once (the policy rotating over the pairs), which covers every
-- pair of values of any two lists (the FP8 layouts, whose emulated products
-- are slow, one cell each: together every pair and policy once);
-- GPTLUA_COMPOSITION=full trains every cell,
-- GPTLUA_COMPOSITION_LAYOUT=text only the layouts whose name has text.
-- A few layouts also resume from their checkpoint to two more steps.  Every
-- cell runs with the journal on (the trainer's default: it hashes the
-- parameters each run's step 3 here, journal_hash_interval 3).
--
-- Tolerances: the rule of spec/support/dist_train.lua (DT.assert_by_rule):
-- a cell's run may differ from one process by twice what the roundings its
-- layout adds make of the same one-process run (its gradients reduced over
-- the cell's ranks in float64, or in float32 under FSDP/HSDP; Muon's float32
-- momentum), measured by a second one-process run perturbed by those
-- roundings, plus the perturbation's own size.  What Newton-Schulz or
-- AdamW's division makes of a rounding is thus measured on the model, not
-- bounded by hand.  The FP8 layouts' float32 models: the rule's float32
-- and FP8 form (DT.rounding_of: any FP8 operand may land on its neighbour).
local H = require 'support.mpi'
local DT = require 'support.dist_train'
local dist = require 'gptlua.dist'
local compose = require 'gptlua.dist.compose'
local train = require 'gptlua.train'
local nanochat = require 'gptlua.models.nanochat'
local ckpt = require 'gptlua.checkpoint'

local ITERS, RESUMED_TO = 3, 5

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

-- the lists ------------------------------------------------------------------
local POLICIES = sorted_keys(dist.POLICIES)
local OPTIMIZERS = sorted_keys(train.OPTIMIZERS)
local MODELS = {}   -- {name, model, over (recipe fields), args}
for _, m in ipairs(sorted_keys(train.MODELS)) do
  if m == 'nanochat' then
    for _, v in ipairs(sorted_keys(nanochat.versions)) do
      MODELS[#MODELS + 1] = { name = 'nanochat ' .. v, model = m, over = { nanochat = { version = v } },
        args = '--nanochat.version=' .. v }
    end
  else
    MODELS[#MODELS + 1] = { name = m, model = m, over = {}, args = '' }
  end
end

-- layouts: ranks, command-line overrides, recipe fields both sides take (over)
local MOE = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, bias_update = 0.01 }
local function FP8(recipe) return { fp8 = recipe, fp8_emulate = true, dtype = 'float32', n_layer = 3 } end
local LAYOUTS = {
  { name = 'plain', ranks = 2, args = '', resume = true },
  { name = 'tp2', ranks = 4, args = '--tp=2', resume = true },
  { name = 'tp2+sp', ranks = 4, args = '--tp=2 --sp' },
  { name = 'cp2 ulysses', ranks = 4, args = '--cp=2' },
  { name = 'cp2 ring', ranks = 4, args = '--cp=2 --cp_mode=ring' },
  { name = 'pp2 1f1b', ranks = 4, args = '--pp=2', resume = true },
  { name = 'pp2 zbh1', ranks = 4, args = '--pp=2 --pp_schedule=zbh1' },
  { name = 'pp4 1f1b', ranks = 4, args = '--pp=4', over = { n_layer = 4 } },
  { name = 'pp4 zbh1', ranks = 4, args = '--pp=4 --pp_schedule=zbh1', over = { n_layer = 4 } },
  -- (Ulysses cuts the heads tp's shard holds over cp: nanochat's 2 KV heads made 4)
  { name = 'tp2 x cp2 ulysses', ranks = 4, args = '--tp=2 --cp=2', over = { n_kv_head = 4 } },
  { name = 'tp2 x cp2 ring', ranks = 4, args = '--tp=2 --cp=2 --cp_mode=ring' },
  { name = 'pp2 x tp2', ranks = 4, args = '--pp=2 --tp=2' },
  { name = 'pp2 x cp2 ulysses', ranks = 4, args = '--pp=2 --cp=2' },
  { name = 'pp2 x cp2 ring', ranks = 4, args = '--pp=2 --cp=2 --cp_mode=ring' },
  { name = 'pp2 x tp2 x dp2', ranks = 8, args = '--pp=2 --tp=2 --dp=2', resume = 'fsdp' },   -- (torchtitan's 3-D layout)
  -- expert parallelism: the models with mixture-of-experts blocks (every
  -- second block: 4 experts, top-2, balancing loss and bias update), the
  -- experts split over ep of the data-parallel ranks
  { name = 'ep2', ranks = 2, args = '--ep=2', over = { moe = MOE }, resume = true },
  { name = 'ep4', ranks = 4, args = '--ep=4', over = { moe = MOE } },
  { name = 'ep2 x tp2', ranks = 4, args = '--ep=2 --tp=2', over = { moe = MOE } },
  { name = 'pp2 x ep2', ranks = 4, args = '--pp=2 --ep=2', over = { moe = MOE } },
  -- (and MoE blocks over a sequence split by cp or by tp's sp: each rank routes its share, gptlua.moe)
  { name = 'cp2 ulysses x moe', ranks = 4, args = '--cp=2', over = { moe = MOE } },
  { name = 'tp2+sp x moe', ranks = 4, args = '--tp=2 --sp', over = { moe = MOE } },
  { name = 'cp2 ring x ep2', ranks = 4, args = '--cp=2 --cp_mode=ring --ep=2', over = { moe = MOE } },
  -- FP8 products (emulated on the CPU, slowly; float32 models of 3 blocks,
  -- the middle one in FP8), by the rule's FP8 form (DT.rounding_of); few:
  -- the default run trains one cell of each, together every model x
  -- optimizer pair and every policy once
  { name = 'fp8 rowwise', ranks = 2, args = '', over = FP8 'rowwise', few = true },
  { name = 'tp2 x fp8 rowwise', ranks = 4, args = '--tp=2', over = FP8 'rowwise', few = true },
  { name = 'tp2+sp x fp8 tensorwise', ranks = 4, args = '--tp=2 --sp', over = FP8 'tensorwise', few = true },
  { name = 'cp2 ulysses x fp8 tensorwise', ranks = 4, args = '--cp=2', over = FP8 'tensorwise', few = true },
  { name = 'cp2 ring x fp8 rowwise', ranks = 4, args = '--cp=2 --cp_mode=ring', over = FP8 'rowwise', few = true },
  { name = 'pp2 x fp8 rowwise', ranks = 4, args = '--pp=2', over = FP8 'rowwise', few = true },
}

-- the refusals the product is allowed to meet: cell -> true when expected
local function meshed(layout) return layout.args:match('%-%-[tcpe]p=') ~= nil end
local REFUSED = {
  { why = 'a policy that does not keep one process\'s parameters, under a mesh',
    cell = function(c) return not compose.MESH_POLICIES[c.policy] and meshed(c.layout) end,
    says = 'with .* > 1 is not supported' },
}

-- the cells ------------------------------------------------------------------
local function recipe_over(layout, model, optimizer, extra)
  local over = { optimizer = optimizer }
  for k, v in pairs(model.over) do over[k] = v end
  for k, v in pairs(layout.over or {}) do over[k] = v end
  for k, v in pairs(extra or {}) do over[k] = v end
  return over
end

-- hsdp's shard groups: half of the ranks that average gradients (dp x cp)
local function shard_args(c)
  if c.policy ~= 'hsdp' then return '' end
  local sizes = require('gptlua.dist.mesh').sizes(c.sizes, c.layout.ranks)
  return (' --shard_size=%d'):format(math.max(1, sizes.dp * sizes.cp / 2))
end

local function cell_args(c)
  local args = ('--dist=%s --journal_hash_interval=3 %s %s'):format(c.policy, c.layout.args, c.model.args)
  for k, v in pairs(c.layout.over or {}) do
    if type(v) == 'table' then   -- (a group of keys: moe = {experts = 4} as --moe.experts=4)
      for k2, v2 in pairs(v) do args = args .. (' --%s.%s=%s'):format(k, k2, tostring(v2)) end
    else args = args .. (' --%s=%s'):format(k, tostring(v)) end
  end
  if c.policy == 'hsdp' then args = args .. shard_args(c) end
  return args
end

local function words(s) local out = {} for w in s:gmatch('%S+') do out[#out + 1] = w end return out end

local cells = {}
for _, layout in ipairs(LAYOUTS) do
  local sizes = {}
  for d, v in layout.args:gmatch('%-%-(%a%a)=(%d+)') do sizes[d] = tonumber(v) end
  for _, policy in ipairs(POLICIES) do
    for _, model in ipairs(MODELS) do
      for _, optimizer in ipairs(OPTIMIZERS) do
        local c = { layout = layout, policy = policy, model = model, optimizer = optimizer, sizes = sizes }
        c.name = ('%s | %s | %s | %s'):format(layout.name, policy, model.name, optimizer)
        cells[#cells + 1] = c
      end
    end
  end
end

describe('composition of layouts, policies, optimizers and models', function()
  if not H.MPIRUN then
    it('needs mpirun (#mpi)', function() pending('mpirun not found') end)
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)

  -- every cell: refused (one listed line) or to train
  local to_train, refused = {}, 0
  it(('refuses a layout in one line before anything runs, only where it is listed (%d cells asked)'):format(#cells),
    function()
    for _, c in ipairs(cells) do
      if not compose.MESH_POLICIES[c.policy] and not meshed(c.layout) then goto elsewhere end
      local args = words(cell_args(c))
      args[#args + 1] = '--optimizer=' .. c.optimizer
      local msg = train.refusal(DT.recipe(c.model.model, recipe_over(c.layout, c.model, c.optimizer)), args,
        c.layout.ranks)
      local expected
      for _, r in ipairs(REFUSED) do if r.cell(c) then expected = r end end
      if msg then
        refused = refused + 1
        assert.is_nil(msg:find('\n'), c.name .. ': a refusal in more than one line: ' .. msg)
        assert.is_nil(msg:match('%.lua:%d+:'), c.name .. ': a refusal with a position (a bug): ' .. msg)
        assert.truthy(expected, c.name .. ': refused, and no listed refusal covers it: ' .. msg)
        assert.truthy(msg:match(expected.says), c.name .. ': refused as "' .. msg .. '", expected ' .. expected.why)
      else
        assert.is_nil(expected, c.name .. ': expected a refusal (' .. (expected and expected.why or '') .. ')')
        to_train[#to_train + 1] = c
      end
      ::elsewhere::
    end
    print(('\n  composition: %d cells, %d refused, %d train'):format(#cells, refused, #to_train))
  end)

  -- the cells that train: a covering subset (see the header) or all
  local function chosen()
    local only = os.getenv('GPTLUA_COMPOSITION_LAYOUT')
    if only then
      local some = {}
      for _, c in ipairs(to_train) do if c.layout.name:find(only, 1, true) then some[#some + 1] = c end end
      to_train = some
    end
    if os.getenv('GPTLUA_COMPOSITION') == 'full' then return to_train end
    local by_layout, picked = {}, {}
    for _, c in ipairs(to_train) do
      local l = by_layout[c.layout] or {}
      by_layout[c.layout] = l
      l[#l + 1] = c
    end
    local few = 0
    for li, layout in ipairs(LAYOUTS) do
      local list, seen_policy, k = by_layout[layout] or {}, {}, li
      local pairs_seen = {}
      if layout.few then  -- one cell: the few layouts' next model x optimizer pair, with their next policy
        few = few + 1
        local n = 0
        for _, model in ipairs(MODELS) do
          for _, optimizer in ipairs(OPTIMIZERS) do
            n = n + 1
            if n == (few - 1) % (#MODELS * #OPTIMIZERS) + 1 then
              local options = {}
              for _, c in ipairs(list) do if c.model == model and c.optimizer == optimizer then options[#options + 1] = c end end
              if #options > 0 then picked[#picked + 1] = options[(few - 1) % #options + 1] end
            end
          end
        end
        goto next_layout
      end
      for _, model in ipairs(MODELS) do
        for _, optimizer in ipairs(OPTIMIZERS) do
          -- the next policy in rotation that trains this pair here
          local options = {}
          for _, c in ipairs(list) do if c.model == model and c.optimizer == optimizer then options[#options + 1] = c end end
          if #options > 0 then
            local c = options[k % #options + 1]
            k = k + 1
            picked[#picked + 1], seen_policy[c.policy] = c, true
            pairs_seen[c] = true
          end
        end
      end
      for _, c in ipairs(list) do  -- a policy the rotation missed
        if not seen_policy[c.policy] then picked[#picked + 1], seen_policy[c.policy] = c, true end
      end
      ::next_layout::
    end
    return picked
  end

  -- a refusal as a user meets it: `gptlua -n N recipe` prints the one line
  -- (rank 0, once) and exits 1; no traceback, no launcher banner
  it('gptlua -n prints a refusal in one line and exits 1 (mpirun and TCP launchers; a bad key before any rank '
    .. 'meets the others)', function()
    local recipe = ' recipes/shakespeare.lua --max_iters=1 --eval_interval=0 --out_dir=' .. out .. '/refused'
    for _, run in ipairs({
      { '-n 4' .. recipe .. ' --pp=2 --dist=localsgd',
        "config: dist 'localsgd' with pp > 1 is not supported (expected 'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp' "
        .. 'over the dp dimension)' },
      { '-n 2 --launcher=tcp' .. recipe .. ' --dist=hsdp',
        'config: hsdp needs shard_size dividing the world size 2 (ranks per shard group), got 0' },
      { '-n 2' .. recipe .. ' --max_iterz=1', 'config: unknown key --max_iterz (did you mean --max_iters?)' },
    }) do
      local o, rc = H.sh(H.EXE .. ' ' .. run[1], 60)
      assert.equal(1, rc, o)
      assert.equal(run[2] .. '\n', o)
    end
  end)

  it('trains every composed cell equal to one process at the same global batch (journal on; resumed in a subset)',
    function()
    assert.is_true(#to_train > 0, 'no cell trains: the refusal test above must run first')
    local list = chosen()
    local cases, resumed_layout = {}, {}
    for i, c in ipairs(list) do
      local fsdp = c.policy == 'fsdp' or c.policy == 'hsdp'
      local perturb = DT.rounding_of(c.layout.ranks, fsdp and 'float32' or 'float64', c.optimizer == 'nanochat',
        c.layout.over)
      local case = { ranks = c.layout.ranks, model = c.model.model, iters = ITERS, name = 'c' .. i, perturb = perturb,
        what = c.name, args = cell_args(c) .. ' --optimizer=' .. c.optimizer, cell = c }
      cases[#cases + 1] = case
      -- the layout's first cell (of the policy it names), resumed to step 5
      if c.layout.resume and not resumed_layout[c.layout] and (c.layout.resume == true or c.layout.resume == c.policy) then
        resumed_layout[c.layout] = true
        cases[#cases + 1] = { ranks = c.layout.ranks, model = c.model.model, iters = RESUMED_TO, name = 'c' .. i .. 'r',
          perturb = perturb, what = c.name .. ' (resumed at step 3)', cell = c, resumed = true,
          args = case.args .. (' --resume=%s/c%d/p/checkpoints/step_%07d'):format(out, i, ITERS) }
      end
    end
    -- a run against the one-process reference: losses and norms of its steps, parameters after its last
    local function check(case, res)
      local c = case.cell
      local over = recipe_over(c.layout, c.model, c.optimizer, { max_iters = RESUMED_TO })
      local ref, refp = runs:reference(c.model.model, over), runs:reference(c.model.model, over, case.perturb)
      local function at(r, step) return ckpt.load(('%s/p/checkpoints/step_%07d'):format(r.dir, step)).model end
      if case.resumed then
        DT.assert_by_rule(ref, refp, case.perturb, res, { ITERS + 1, RESUMED_TO })
      else
        DT.assert_by_rule(ref, refp, case.perturb, res, { 1, ITERS }, at(ref, ITERS), at(refp, ITERS))
      end
    end
    local got = runs:launch(cases)
    local n_equal, unequal = 0, {}
    for i, case in ipairs(cases) do
      local ok, err = pcall(check, case, got[i])
      if ok then n_equal = n_equal + 1
      else
        local line = tostring(err):match('[^\n]*')
        if not line:find(case.what, 1, true) then line = case.what .. ': ' .. line end
        unequal[#unequal + 1] = line
      end
    end
    -- every unequal cell named, not only the first
    assert.equal(0, #unequal, ('%d of %d runs differ from one process:\n%s'):format(#unequal, #cases,
      table.concat(unequal, '\n')))
    print(('\n  composition: %d runs equal to one process (%d cells, %d resumed)'):format(n_equal, #list,
      #cases - #list))
  end)
end)
