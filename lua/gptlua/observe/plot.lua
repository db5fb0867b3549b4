-- gptlua.observe.plot — `gptlua plot runs/a [runs/b ...]`: the curves of one
-- or several runs, drawn by gnuplot (Debian's gnuplot-nox) from their
-- metrics.jsonl.
--
--   gptlua plot runs/shakespeare                       -> runs/shakespeare/plot.png
--   gptlua plot runs/a runs/b --out=cmp.png            several runs overlaid
--   gptlua plot runs/a --terminal                      also a loss plot in the terminal
--
-- One PNG of six panels: loss (train, and eval val dashed) against steps
-- and against tokens, learning rate, gradient norm, tokens/s and MFU, each
-- run in its own colour.  Records are those Trainer:write_metrics writes:
-- {step, loss, lr, grad_norm, tokens_per_sec, mfu, ms_per_step, ...} and
-- {step, eval = true, train_loss, val_loss}; other fields (a timestamp, a
-- run id) are ignored, skipped steps and non-finite values ("nan") leave a
-- gap.  Tokens are the record's `tokens` when it has one, else step x
-- tokens per step (tokens_per_sec x ms_per_step / 1000, which is exactly
-- the tokens of a step over its time, times that time).
local cjson = require 'cjson'

local M = {}

local USAGE = [[
usage: gptlua plot RUN [RUN ...] [--out=FILE.png] [--size=WxH] [--terminal]
  RUN         a run directory (holding metrics.jsonl) or a metrics.jsonl file
  --out       the PNG to write (default: RUN/plot.png for one run, plot.png for several)
  --size      the PNG's size in pixels (default 1200x900)
  --terminal  also print the loss curves as text
]]
M.USAGE = USAGE

local function fail(msg) error('plot: ' .. msg, 0) end

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

local function is_dir(p)
  local f = io.open(p .. '/.', 'rb')
  if f then f:close() end
  return f ~= nil
end

-- The records of a run: {label, path, train = {{step, tokens, loss, lr,
-- grad_norm, tokens_per_sec, mfu}, ...}, eval = {{step, tokens, train_loss,
-- val_loss}, ...}} (fields nil where the record has none or it is not finite)
function M.read_run(run)
  local path = run
  if is_dir(run) then path = run:gsub('/+$', '') .. '/metrics.jsonl' end
  local f = io.open(path, 'rb')
  if not f then
    fail(('%s has no metrics.jsonl (expected a run directory or a metrics.jsonl file)'):format(run))
  end
  local label = path:match('([^/]+)/metrics%.jsonl$') or path:match('([^/]+)$')
  local out = { label = label, path = path, train = {}, eval = {}, marks = {}, tasks = {}, task_seen = {} }
  local n, per_step = 0, nil
  for line in f:lines() do
    n = n + 1
    if line:match('%S') then
      local ok, rec = pcall(cjson.decode, line)
      if not ok or type(rec) ~= 'table' then
        f:close()
        fail(('%s:%d: expected a JSON record, got %q'):format(path, n, line:sub(1, 60)))
      end
      if not finite(rec.step) then
        f:close()
        fail(('%s:%d: the record has no step'):format(path, n))
      end
      if type(rec.run) == 'string' and out.run == nil then out.run = rec.run end
      local function num(k) return finite(rec[k]) and rec[k] or nil end
      if not per_step and num('tokens_per_sec') and num('ms_per_step') then
        per_step = math.floor(rec.tokens_per_sec * rec.ms_per_step / 1000 + 0.5)
      end
      -- resumes and live changes (gptlua attach's set{} and reload) are marked on the step axis
      if rec.resumed then out.marks[#out.marks + 1] = { step = rec.step, what = 'resumed' }
      elseif rec.event == 'control' and type(rec.command) == 'string' and rec.ok ~= false then
        local what = rec.command:match('^%s*(set)%s*[{(]') or rec.command:match('^%s*(reload)%s*[%s(\'"]')
        if what then out.marks[#out.marks + 1] = { step = rec.step, what = what } end
      end
      if rec.event then   -- an event, not a step's numbers
      elseif rec.eval then
        local row = { step = rec.step, tokens = num('tokens'), train_loss = num('train_loss'),
                      val_loss = num('val_loss'), val_bpb = num('val_bpb') }
        -- each multiple-choice task's accuracy (gptlua.eval: task_<name>_acc)
        for k in pairs(rec) do
          local task = type(k) == 'string' and k:match('^task_(.+)_acc$')
          if task and num(k) then
            row.tasks = row.tasks or {}
            row.tasks[task] = rec[k]
            if not out.task_seen[task] then out.task_seen[task] = true; out.tasks[#out.tasks + 1] = task end
          end
        end
        out.eval[#out.eval + 1] = row
      elseif not rec.skipped then
        out.train[#out.train + 1] = { step = rec.step, tokens = num('tokens'), loss = num('loss'), lr = num('lr'), lr_mult = num('lr_mult'),
          grad_norm = num('grad_norm'), tokens_per_sec = num('tokens_per_sec'),
          mfu = num('mfu') and 100 * rec.mfu or nil,
          moe_load_max_mean = num('moe_load_max_mean'), moe_dropped = num('moe_dropped') }  -- (gptlua.moe)
      end
    end
  end
  f:close()
  table.sort(out.tasks)
  if #out.train == 0 and #out.eval == 0 then fail(('%s holds no records'):format(path)) end
  for _, list in ipairs({ out.train, out.eval }) do
    for _, r in ipairs(list) do
      if not r.tokens and per_step then r.tokens = r.step * per_step end
    end
  end
  return out
end

-- ------------------------------------------------------------- gnuplot
local TRAIN_COLS = { 'step', 'tokens', 'loss', 'lr', 'grad_norm', 'tokens_per_sec', 'mfu', 'lr_mult',
                     'moe_load_max_mean', 'moe_dropped' }
local EVAL_COLS = { 'step', 'tokens', 'train_loss', 'val_loss', 'val_bpb' }

local function write_table(path, rows, cols)
  local f = assert(io.open(path, 'wb'))
  for _, r in ipairs(rows) do
    local line = {}
    for i, c in ipairs(cols) do line[i] = r[c] and ('%.10g'):format(r[c]) or '?' end
    f:write(table.concat(line, ' '), '\n')
  end
  f:close()
end

local function has(rows, col)
  for _, r in ipairs(rows) do if r[col] then return true end end
  return false
end

-- a gnuplot single-quoted string
local function q(s) return "'" .. tostring(s):gsub("'", "''") .. "'" end

local function col_index(cols, name)
  for i, c in ipairs(cols) do if c == name then return i end end
end

-- one panel: series = {{file, x col, y col, title, colour, dashed}, ...}
local function panel(out, title, xlabel, ylabel, series, logy)
  out[#out + 1] = ('set title %s; set xlabel %s; set ylabel %s'):format(q(title), q(xlabel), q(ylabel))
  -- a log axis spans the data, not whole decades around it
  out[#out + 1] = logy and 'set logscale y; set autoscale yfix' or 'unset logscale y; set autoscale y'
  if #series == 0 then
    out[#out + 1] = "unset logscale y; set label 1 'no data' at graph 0.45, graph 0.5; plot [0:1][0:1] -1 notitle; unset label 1"
    return
  end
  local parts = {}
  for _, s in ipairs(series) do
    -- a series of one point (a run that logged once) is drawn as a point: a line needs two
    parts[#parts + 1] = ('%s using %d:%d with %s lc %d %s title %s'):format(q(s[1]), s[2], s[3],
      s[7] and 'points pt 7 ps 1.5' or 'lines lw 1.5', s[5], s[6] and 'dt 2' or 'dt 1', q(s[4]))
  end
  out[#out + 1] = 'plot ' .. table.concat(parts, ', ')
end

-- ytics for a log axis over the runs' values of the columns cols: a log axis
-- labels only powers of ten, and a loss curve spans less than one decade
local LOSSES = { { 'train', 'loss' }, { 'eval', 'val_loss' } }
local function log_tics(runs, cols)
  local lo, hi = math.huge, 0
  for _, r in ipairs(runs) do
    for _, c in ipairs(cols) do
      for _, row in ipairs(r[c[1]]) do
        local v = row[c[2]]
        if v and v > 0 then lo, hi = math.min(lo, v), math.max(hi, v) end
      end
    end
  end
  if hi == 0 then return 'set ytics autofreq' end
  local tics = {}
  for e = math.floor(math.log10(lo)), math.ceil(math.log10(hi)) do
    for _, m in ipairs({ 1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8 }) do
      local v = m * 10 ^ e
      if v >= lo * 0.95 and v <= hi * 1.05 then tics[#tics + 1] = ('%g'):format(v) end
    end
  end
  if #tics < 2 then return 'set ytics autofreq' end
  return 'set ytics (' .. table.concat(tics, ', ') .. ')'
end

-- a dotted vertical line at each step a run was resumed or changed live, named at the top
local function marks(out, runs)
  local n = 0
  for i, r in ipairs(runs) do
    for _, m in ipairs(r.marks or {}) do
      n = n + 1
      out[#out + 1] = ('set arrow %d from %s, graph 0 to %s, graph 1 nohead dt 3 lc %d'):format(n, m.step, m.step, i)
      out[#out + 1] = ('set label %d %s at %s, graph 0.97 rotate by 90 right offset -0.6, 0 font ",8" tc lt %d')
        :format(n, q(m.what), m.step, i)
    end
  end
end

-- the gnuplot script drawing runs (data files in dir) on the current terminal
local function panels(runs, dir, only_loss)
  local out = { "set datafile missing '?'", 'set grid', 'set offsets graph 0, graph 0, graph 0.05, graph 0.05', 'set key top right noautotitle', 'set format y "%g"' }
  local function series(kind, xcol, ycol, suffix, dashed)
    local list = {}
    for i, r in ipairs(runs) do
      local rows, cols = r[kind], kind == 'train' and TRAIN_COLS or EVAL_COLS
      if has(rows, xcol) and has(rows, ycol) then
        local n = 0
        for _, row in ipairs(rows) do if row[xcol] and row[ycol] then n = n + 1 end end
        list[#list + 1] = { ('%s/run%d_%s.dat'):format(dir, i, kind), col_index(cols, xcol), col_index(cols, ycol),
          r.label .. suffix, i, dashed, n == 1 }
      end
    end
    return list
  end
  local function loss_series(x)
    local s = series('train', x, 'loss', ' train')
    for _, e in ipairs(series('eval', x, 'val_loss', ' val', true)) do s[#s + 1] = e end
    return s
  end
  if only_loss then
    marks(out, runs)
    out[#out + 1] = log_tics(runs, LOSSES)
    panel(out, 'loss', 'step', 'loss', loss_series('step'), true)
    return table.concat(out, '\n')
  end
  local names = {}
  for _, r in ipairs(runs) do names[#names + 1] = r.label end
  -- a row when a run evaluated bits per byte or tasks (gptlua.eval), and one
  -- for mixture-of-experts runs: the worst layer's expert load and the assignments dropped
  local evals, moe = false, false
  for _, r in ipairs(runs) do
    if has(r.eval, 'val_bpb') or #r.tasks > 0 then evals = true end
    if has(r.train, 'moe_load_max_mean') then moe = true end
  end
  out[#out + 1] = ('set multiplot layout %d,2 title %s'):format(3 + (evals and 1 or 0) + (moe and 1 or 0),
    q('gptlua: ' .. table.concat(names, ', ')))
  -- losses on a log scale: the first steps' loss (ln V at the start) does not squeeze the rest
  marks(out, runs)
  out[#out + 1] = log_tics(runs, LOSSES)
  panel(out, 'loss vs steps', 'step', 'loss', loss_series('step'), true)
  out[#out + 1] = 'unset arrow; unset label'
  panel(out, 'loss vs tokens', 'tokens', 'loss', loss_series('tokens'), true)
  out[#out + 1] = 'set ytics autofreq'
  -- the schedule's multiplier of every group's peak rate when each run has it (an optimizer with several
  -- groups, nanochat's, has no one 'lr'), else the rate
  local every_mult = true
  for _, r in ipairs(runs) do if not has(r.train, 'lr_mult') then every_mult = false end end
  if every_mult then
    panel(out, 'learning rate / peak (schedule)', 'step', 'x peak', series('train', 'step', 'lr_mult', ''))
  else
    panel(out, 'learning rate', 'step', 'lr', series('train', 'step', 'lr', ''))
  end
  out[#out + 1] = log_tics(runs, { { 'train', 'grad_norm' } })
  panel(out, 'gradient norm', 'step', 'norm', series('train', 'step', 'grad_norm', ''), true)
  out[#out + 1] = 'set ytics autofreq'
  panel(out, 'throughput', 'step', 'tokens/s', series('train', 'step', 'tokens_per_sec', ''))
  panel(out, 'MFU', 'step', 'MFU %', series('train', 'step', 'mfu', ''))
  if evals then
    panel(out, 'val bits per byte', 'step', 'bpb', series('eval', 'step', 'val_bpb', ' val', true))
    local list = {}
    for i, r in ipairs(runs) do
      for j, task in ipairs(r.tasks) do
        local n = 0
        for _, row in ipairs(r.eval) do if row.tasks and row.tasks[task] then n = n + 1 end end
        list[#list + 1] = { ('%s/run%d_task%d.dat'):format(dir, i, j), 1, 2, r.label .. ' ' .. task, i, j > 1, n == 1 }
      end
    end
    panel(out, 'task accuracy (per token)', 'step', 'accuracy', list)
  end
  if moe then
    panel(out, 'MoE expert load, max / mean (worst layer)', 'step', 'max / mean',
      series('train', 'step', 'moe_load_max_mean', ''))
    panel(out, 'MoE assignments dropped', 'step', 'fraction', series('train', 'step', 'moe_dropped', ''))
  end
  out[#out + 1] = 'unset multiplot'
  return table.concat(out, '\n')
end
M.script = panels   -- (specs read the script)

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- runs gnuplot on script; returns its stdout, or fails with its message
local function gnuplot(dir, script)
  local sp = dir .. '/plot.gp'
  local f = assert(io.open(sp, 'wb'))
  f:write(script, '\n')
  f:close()
  local p = io.popen(('gnuplot %s 2>%s; echo "__rc=$?"'):format(shell_quote(sp), shell_quote(dir .. '/err')))
  local out = p:read('*a')
  p:close()
  local rc = tonumber(out:match('__rc=(%d+)%s*$'))
  local ef = io.open(dir .. '/err', 'rb')
  local err = ef and ef:read('*a') or ''
  if ef then ef:close() end
  if rc ~= 0 then
    fail(('gnuplot failed (exit %s): %s'):format(tostring(rc), (err:gsub('%s+$', ''):sub(-400))))
  end
  return (out:gsub('__rc=%d+%s*$', ''))
end

function M.have_gnuplot()
  local r = os.execute('command -v gnuplot >/dev/null 2>&1')
  return r == 0 or r == true
end

-- Plots runs (a list of run directories or metrics.jsonl files).  opts:
-- out (the PNG; default as USAGE says), width, height, terminal (true:
-- returns the text plot too).  Returns the PNG's path and the text plot.
function M.plot(run_paths, opts)
  opts = opts or {}
  if #run_paths == 0 then fail('expected at least one run directory\n' .. USAGE) end
  if not M.have_gnuplot() then fail('gnuplot not found on PATH (Debian: apt-get install gnuplot-nox)') end
  local runs = {}
  for i, p in ipairs(run_paths) do runs[i] = M.read_run(p) end
  -- two runs of the same name (runs/x and other/x) keep apart by path
  local seen = {}
  for _, r in ipairs(runs) do
    if seen[r.label] then r.label = r.path:gsub('/metrics%.jsonl$', '') end
    seen[r.label] = true
  end
  local out = opts.out
  if not out then
    out = #runs == 1 and runs[1].path:gsub('metrics%.jsonl$', 'plot.png') or 'plot.png'
    if out == '' or out == runs[1].path then out = 'plot.png' end
  end
  if not out:match('%.png$') then fail(('--out expected a .png file, got %s'):format(out)) end
  local w, h = opts.width or 1200, opts.height or 900
  local dir = os.tmpname()
  os.remove(dir)
  require('gptlua.checkpoint').mkdir_p(dir)
  local ok, res = pcall(function()
    for i, r in ipairs(runs) do
      write_table(('%s/run%d_train.dat'):format(dir, i), r.train, TRAIN_COLS)
      write_table(('%s/run%d_eval.dat'):format(dir, i), r.eval, EVAL_COLS)
      for j, task in ipairs(r.tasks) do
        local rows = {}
        for _, row in ipairs(r.eval) do
          if row.tasks and row.tasks[task] then rows[#rows + 1] = { step = row.step, acc = row.tasks[task] } end
        end
        write_table(('%s/run%d_task%d.dat'):format(dir, i, j), rows, { 'step', 'acc' })
      end
    end
    -- written beside its final name, then renamed: never a half PNG there
    local tmp = out .. '.tmp'
    gnuplot(dir, ('set terminal pngcairo size %d,%d noenhanced font ",9"\nset output %s\n%s\nset output\n'):format(
      w, h, q(tmp), panels(runs, dir)))
    local rok, rerr = os.rename(tmp, out)
    if not rok then os.remove(tmp); fail(('cannot write %s (%s)'):format(out, tostring(rerr))) end
    if opts.terminal then
      return gnuplot(dir, ('set terminal dumb size 100,28 noenhanced\n%s\n'):format(panels(runs, dir, true)))
    end
  end)
  os.execute('rm -rf ' .. shell_quote(dir))
  if not ok then error(res, 0) end
  return out, res
end

-- the command line: gptlua plot RUN [RUN ...] [--out=F] [--size=WxH] [--terminal]
local function main(args)
  local runs, opts = {}, {}
  for _, a in ipairs(args) do
    local k, v = a:match('^%-%-([%w_]+)=(.*)$')
    if a == '-h' or a == '--help' then io.write(USAGE) return 0
    elseif a == '--terminal' then opts.terminal = true
    elseif k == 'out' then opts.out = v
    elseif k == 'size' then
      local w, h = v:match('^(%d+)x(%d+)$')
      w, h = tonumber(w), tonumber(h)
      if not (w and h and w >= 200 and h >= 150 and w <= 10000 and h <= 10000) then
        fail(('--size expected WxH in pixels (200x150 to 10000x10000), got %s'):format(v))
      end
      opts.width, opts.height = w, h
    elseif a:sub(1, 1) == '-' then fail(('unknown option %s\n%s'):format(a, USAGE))
    else runs[#runs + 1] = a end
  end
  -- a run's name is its newest run, unless another run of that name is named
  -- too (plot runs/a-1 runs/a-2 overlays exactly those two: runs/a-1 is runs/a)
  local function family(p) return (p:gsub('/+$', ''):gsub('%-%d+$', '')) end
  local R = require 'gptlua.runs'
  for i, a in ipairs(runs) do
    local alone = true
    for j, b in ipairs(runs) do if i ~= j and family(b) == family(a) then alone = false end end
    local run, note = (alone and R.resolve or R.first)(a)
    if note then io.stderr:write('plot: ', note, '\n') end
    runs[i] = run
  end
  local out, text = M.plot(runs, opts)
  if text then io.write(text) end
  io.write(('plot: wrote %s\n'):format(out))
  return 0
end

-- the exit status of the command line; a user's mistake (a message
-- starting "plot: ") is one line on stderr, anything else a bug raised on
function M.main(args)
  local ok, res = pcall(main, args)
  if ok then return res end
  if type(res) == 'string' and res:match('^plot: ') then
    io.stderr:write(res, '\n')
    return 1
  end
  error(res, 0)
end

return M
