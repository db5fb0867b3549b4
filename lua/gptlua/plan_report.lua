-- gptlua.plan_report — what `gptlua --plan` prints (gptlua.plan makes the
-- numbers), and the byte sizes it reads and writes.
local M = {}

local function fail(msg) error('plan: ' .. msg, 0) end

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

local function pad(s, n) return s .. string.rep(' ', math.max(0, n - #s)) end
local function lpad(s, n) return string.rep(' ', math.max(0, n - #s)) .. s end

M.GROUPS = { 'parameters', 'gradients', 'optimizer state', 'master weights', 'communication buffers', 'data',
  'activations' }

local function sorted_keys(t, by)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, by or function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

-- The mixture of experts: parameters with every expert against those a
-- token uses, the experts each rank holds, and the rows each layer's
-- dispatch gives the grouped products (N K, or E x capacity).
function M.render_moe(r, w)
  local m = r.moe
  w(('mixture of experts: %d MoE layer%s of %d experts (%d per rank%s), top-%d, expert hidden %d, %s; parameters '
    .. '%.2fM with every expert, %.2fM active per token (experts %.2fM of the total)'):format(m.layers,
    m.layers == 1 and '' or 's', m.experts, m.experts_per_rank, m.ep > 1 and (', ep ' .. m.ep) or '', m.top_k, m.hidden,
    m.capacity_factor > 0 and ('capacity factor %g'):format(m.capacity_factor) or 'dropless',
    m.total_params / 1e6, m.active_params / 1e6, m.expert_params / 1e6))
  -- (one line per distinct shape: pipeline stages or context parallel
  -- ranks see their own tokens)
  local lines, count = {}, {}
  for _, l in ipairs(sorted_keys(r.moe_shapes or {})) do
    local s = r.moe_shapes[l]
    local how = s.rows == s.tokens * s.top_k and ('N K = %d x %d'):format(s.tokens, s.top_k)
      or ('E x capacity = %d x %d'):format(m.experts, s.rows / m.experts)
    local line = ('  dispatch per micro-step: %d tokens -> %d rows (%s) into the grouped products'):format(s.tokens,
      s.rows, how)
    if not count[line] then lines[#lines + 1] = line end
    count[line] = (count[line] or 0) + 1
  end
  for _, line in ipairs(lines) do w(line, #lines > 1 and (' (%d layers)'):format(count[line]) or '') end
end

function M.render(r)
  local cfg = r.config
  local lines = {}
  local function w(...) lines[#lines + 1] = table.concat({ ... }) end
  local mc = r.model_config or cfg   -- the model's own sizes (nanochat's depth dial sets them)
  w(('memory plan for %s: %s, %.2fM parameters (%d layers, width %d, context %d, vocab %d)'):format(
    tostring(r.name), cfg.model, r.num_params / 1e6, mc.n_layer, mc.n_embd, mc.block_size, mc.vocab_size))
  local pol = cfg.dist
  local poltxt = pol == 'hsdp' and ('hsdp (shard groups of %d, %d replicas)'):format(cfg.shard_size,
    r.world / cfg.shard_size) or pol
  -- a device mesh: the policy runs over dp (x cp), tensor/context parallel inside
  if (cfg.tp or 1) > 1 or (cfg.cp or 1) > 1 then
    poltxt = ('%s over dp, mesh tp %d%s, cp %d'):format(poltxt, cfg.tp or 1, cfg.sp and ' + sp' or '', cfg.cp or 1)
  end
  w(('policy %s on %d rank%s (rank %d planned), %s, micro-batch %d x %d, accumulation %d, optimizer %s, '
    .. 'activation checkpointing %s'):format(poltxt, r.world, r.world == 1 and '' or 's', r.rank, cfg.dtype,
    cfg.batch_size, cfg.block_size, r.accum, cfg.optimizer, cfg.activation_checkpointing and 'on' or 'off'))
  if pol == 'none' and r.world > 1 then
    w(("note: dist = 'none' trains each of the %d ranks alone; --dist=ddp|zero1|zero2|fsdp|hsdp shares the work")
      :format(r.world))
  end
  if r.pipeline then  -- pipeline stages (--pp): the schedule as a timeline, its bubble in unit time
    w(r.pipeline.text)
    w((require('gptlua.dist.schedules').format(r.pipeline.schedule)))
  end
  if r.moe then M.render_moe(r, w) end
  if r.note then w('note: ', r.note) end
  if r.device ~= 'cpu' then
    w(('note: planned for %s with the allocator\'s classes and caching (shared by CPU and CUDA); the dataset\'s host '
      .. 'tensors are counted with it'):format(r.device))
  end
  w('')
  w("the trainer's own step, run on the meta device (two optimizer steps, every micro-step; no kernel, no memory):")
  w('  live at the peak            per rank')
  local g = r.groups
  for _, k in ipairs(M.GROUPS) do
    w('  ', pad(k, 26), lpad(fmt(g[k] or 0), 12))
    if k == 'activations' and g.layers then
      local keys = sorted_keys(g.layers, function(a, b) return g.layers[a] > g.layers[b] end)
      for i, l in ipairs(keys) do
        if i > 8 then w(('      ... and %d more'):format(#keys - 8)); break end
        w('    ', pad(l, 24), lpad(fmt(g.layers[l]), 12))
      end
      for _, part in ipairs(sorted_keys(g.moe or {})) do  -- (in the layers above)
        w('    of which ', pad(part, 28), lpad(fmt(g.moe[part]), 12))
      end
    end
  end
  local held = 0
  for _, k in ipairs(M.GROUPS) do held = held + (g[k] or 0) end
  if r.peak - held > 0 then w('  ', pad('held by the engine', 26), lpad(fmt(r.peak - held), 12), '   (the loaders\' rings)') end
  w('  ', pad('peak (total)', 26), lpad(fmt(r.peak), 12))
  w('')
  local groups = sorted_keys(r.traffic)
  local any = false
  for _, name in ipairs(groups) do
    local t = r.traffic[name]
    if t.calls > 0 then
      if not any then w('collectives per optimizer step (bytes this rank sends):'); any = true end
      local by = {}
      for _, c in ipairs(sorted_keys(t.by)) do by[#by + 1] = ('%s %s x%d'):format(c, fmt(t.by[c].bytes), t.by[c].calls) end
      w(('  %s (%d ranks): %s in %d calls: %s'):format(name, t.size, fmt(t.bytes), t.calls, table.concat(by, ', ')))
    end
  end
  if any then w('') end
  local src = r.memory_from
  w(('device memory %s (%s); usable %s with a %d%% margin'):format(fmt(r.device_memory), src, fmt(r.usable),
    math.floor(r.margin * 100 + 0.5)))
  if r.fits then
    w(('fits: %s of %s usable (%s to spare)'):format(fmt(r.peak), fmt(r.usable), fmt(r.usable - r.peak)))
  else
    w(('does NOT fit: needs %s, %s usable (%s over)'):format(fmt(r.peak), fmt(r.usable), fmt(r.peak - r.usable)))
    if #r.suggestions > 0 then
      w('suggestions (each planned):')
      for _, s in ipairs(r.suggestions) do
        w(('  %s: peak %s, %s  [%s]'):format(s.flags, fmt(s.total), s.fits and 'fits' or 'does not fit', s.why))
      end
    end
  end
  return table.concat(lines, '\n') .. '\n'
end

return M
