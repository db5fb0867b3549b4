-- Run by spec/control_spec.lua and spec/journal_spec.lua: a tiny recipe
-- (copied into the spec's temporary directory, so the attach spec can edit
-- its lr_schedule and `reload` it).  LR_FACTOR is the line the spec edits.
-- PERTURB_AT=N (journal spec): on_log adds 1e-3 to one weight after step
-- N-1, so step N of a replay differs from the journal; LIVE_PAUSE_AT=N
-- pauses the job there (the journal spec changes it live at a known step);
-- COLL_MISMATCH_AT=N makes the ranks' collectives differ in step N.
local LR_FACTOR = 1.0
return {
  name = 'live', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
  n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, batch_size = 2, max_iters = 20000,
  eval_interval = 0, eval_iters = 2, log_interval = 1, sample_length = 0, warmup_iters = 5, device = 'cpu',
  peak_flops = 1e12, dropout = 0, bias = false, seed = 3, keep_last = 0, quiet = true, tensorboard = false,
  journal_hash_interval = 5,
  lr_schedule = function(cfg)
    return function(step) return math.min(1, (step + 1) / (cfg.warmup_iters + 1)) * LR_FACTOR end
  end,
  on_log = function(t)
    -- LIVE_PAUSE_AT=N: the job pauses itself after step N-1 and waits for `gptlua attach`
    if tonumber(os.getenv('LIVE_PAUSE_AT')) == t.step and t.control then t.control.paused = true end
    -- COLL_MISMATCH_AT=N: the ranks make one all-reduce with different ops after step N-1
    if tonumber(os.getenv('COLL_MISMATCH_AT')) == t.step and t.comm then
      local x = require('gptlua').ones({ 1 }, { dtype = 'float64' })
      t.comm:all_reduce(x, t.rank == 0 and 'min' or 'max')
    end
    if tonumber(os.getenv('PERTURB_AT')) == t.step then
      local w = t.model:parameters()[1]
      require('gptlua').no_grad(function() w:view({ w:numel() }):narrow(1, 1, 1):add_(1e-3) end)
    end
  end,
}
