-- gptlua.train_report — what a training run tells, on rank 0: its opening
-- lines (the model, the batch, the peak MFU is measured against, the layout,
-- the run's directory), the eval lines, the line and the metrics record at
-- every log interval (with the policy's, the stragglers' and the experts'
-- numbers), the closing line; and the one writer of metrics.jsonl.  The
-- loop that decides when (and keeps the time) is gptlua.train's.
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local runs = require 'gptlua.runs'
local progress = require 'gptlua.progress'
local evals = require 'gptlua.eval'
local train_config = require 'gptlua.train_config'
local cjson = require 'cjson'

local M = {}

local fmt_bytes, fmt_time = progress.fmt_bytes, progress.fmt_time

-- The one place metrics records are written (rank 0, run_dir/metrics.jsonl,
-- one JSON object a line); each carries the time (seconds since the epoch)
-- and the run's id.  The trainer's method write_metrics (t: the trainer).
function M.write_metrics(t, rec)
  if t.rank ~= 0 then return end
  if not t.metrics_file then
    ckpt.mkdir_p(t.run_dir)
    -- the directory is this run's own (gptlua.runs): a resumed run appends
    t.metrics_file = assert(io.open(t.run_dir .. '/metrics.jsonl', 'ab'))
  end
  rec.time, rec.run = rec.time or runs.time(), rec.run or t.run_id
  for k, v in pairs(rec) do  -- JSON has no NaN/Inf: write them as strings
    if type(v) == 'number' and (v ~= v or v == math.huge or v == -math.huge) then rec[k] = tostring(v) end
  end
  t.metrics_file:write(cjson.encode(rec), '\n')
  t.metrics_file:flush()
  if t.tensorboard then t.tensorboard:write(rec, t.run_dir) end
end

-- The lines a run opens with; returns the peak FLOP/s per device that MFU
-- is measured against (gptlua.progress).
function M.opening(t)
  local cfg = t.cfg
  local peak, peak_source = progress.peak_flops(cfg)
  local mc = t.model.config or {}
  local padding = ''
  if mc.padded_vocab_size and mc.stored_vocab_size and mc.padded_vocab_size ~= mc.stored_vocab_size then
    padding = (' (padded to %d rows for tp %d: masked in the loss, never sampled, not saved)'):format(
      mc.padded_vocab_size, cfg.tp)
  end
  t:print(('model %s: %.2fM parameters, %d layers, %d heads, width %d, context %d, vocab %d%s'):format(
    cfg.model, (t.whole_num_params or t.model:num_params()) / 1e6, cfg.n_layer, cfg.n_head, cfg.n_embd,
    cfg.block_size, cfg.vocab_size, padding))
  t:print(('device %s (%d threads), %s, batch %d x %d x %d accum x %d ranks = %d tokens/step'):format(
    cfg.device, gl.get_num_threads(), cfg.dtype, cfg.batch_size, cfg.block_size, cfg.gradient_accumulation_steps,
    t.dp_size, t.tokens_per_step))
  t:print(('MFU against a peak of %s per device (%s)'):format(progress.fmt_flops(peak), peak_source))
  if t.fp8_line then t:print(t.fp8_line .. (cfg.device == 'cpu' and ' (emulated on the CPU)' or '')) end
  if t.world > 1 then
    t:print(('dist: %s (%s %d ranks), collective timeout %g s'):format(cfg.dist,
      t.launch.dist_default and 'default for' or 'on', t.world, cfg.dist_timeout))
    if t.mesh then t:print(tostring(t.mesh)) end
  end
  if t.launch.scaled then
    t:print(('max_iters %d: %s; set on the command line, they stay'):format(cfg.max_iters,
      table.concat(t.launch.scaled, ', ')))
  end
  t:print(('run %s writes %s'):format(t.run_id, t.run_dir))
  return peak
end

-- nanoGPT's eval line "step N: train loss X, val loss Y" (and what the
-- eval tasks add), and its metrics record
function M.eval(t, step, ev)
  local rec, more = evals.record(step, ev)
  t:print(('step %d: train loss %.4f, val loss %.4f%s'):format(step, ev.train, ev.val, more))
  t:write_metrics(rec)
end

-- The log interval's line and record.  s: loss, norm, lr_mult (this
-- step's), step_s (its seconds), steps and tokens since the last report,
-- elapsed (their seconds, pauses left out), eta (seconds), peak (opening's).
-- The stragglers' report is a collective: every rank calls this.
function M.log(t, s)
  local cfg = t.cfg
  local tps = s.tokens / s.elapsed
  local mfu = tps * t.flops_per_token / (s.peak * t.world)
  local mem = gl.memory_stats(cfg.device)
  local ms_per_step = 1000 * s.elapsed / s.steps
  -- the scheduled rates by group: 'lr' when every group has the same, else lr_<group> each
  local rates, shown = train_config.group_rates(t.optimizer), {}
  local rec = { step = t.step, loss = s.loss, lr_mult = s.lr_mult, grad_norm = s.norm, tokens_per_sec = tps, mfu = mfu,
    ms_per_step = ms_per_step, step_ms = s.step_s * 1000, mem_peak = mem.peak,
    comm_bytes = t.comm and t.comm.sent_bytes or nil }  -- bytes rank 0 sent so far (gptlua.dist)
  for i, r in ipairs(rates) do
    shown[i] = r[1] == 'lr' and ('lr %.2e'):format(r[2]) or ('%s %.2e'):format(r[1], r[2])
    rec[r[1] == 'lr' and 'lr' or 'lr_' .. r[1]] = r[2]
  end
  if #rates > 1 then shown[1] = 'lr ' .. shown[1] end
  t:print(('step %5d/%d | loss %.4f | %s | norm %.3f | %.0f tok/s | MFU %.1f%% | %.1f ms/step | mem %s | ETA %s'):format(
    t.step, cfg.max_iters, s.loss, table.concat(shown, ' '), s.norm, tps, 100 * mfu, ms_per_step,
    fmt_bytes(mem.peak), fmt_time(s.eta)))
  -- a policy's own numbers (round position, staleness, ...)
  if t.policy.metrics then for k, v in pairs(t.policy:metrics()) do rec[k] = v end end
  local slow = t.stragglers and t.stragglers:report(rec)   -- (collective: every rank)
  if slow then t:print(slow) end
  if #t.moe_layers > 0 then  -- expert load, dropped tokens, balancing losses, bias range
    for k, v in pairs(require('gptlua.moe').metrics(t.moe_layers)) do rec[k] = v end
  end
  t:write_metrics(rec)
  if t.hooks.on_log then t.hooks.on_log(t, { loss = s.loss, norm = s.norm, tps = tps }) end
end

-- the closing line: steps run, the time of steps apart from the pauses
-- (evals, samples, checkpoints), the final val loss
function M.done(t, ran, total, paused, last_eval)
  t:print(('done: step %d, %d steps run in %s (%s of steps at %.1f ms/step, %s of evals, samples and checkpoints), '
    .. 'final val loss %s'):format(t.step, ran, fmt_time(total), fmt_time(total - paused),
    1000 * (total - paused) / math.max(1, ran), fmt_time(paused),
    last_eval and string.format('%.4f', last_eval.val) or 'n/a'))
end

return M
