-- Run by spec/dist_stop_spec.lua as `gptlua -n 2 spec/dist/stop_recipe.lua
-- --out_dir=DIR --dist=P`: a tiny recipe that trains until it is stopped
-- (SIGINT to the launcher or to one rank).  Each rank writes its pid to
-- DIR/pid.RANK, so the spec can signal one rank.
local train = require 'gptlua.train'
return {
  name = 'stop', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
  -- max_iters: a bound should a spec fail to stop it (each run is stopped within seconds)
  n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, batch_size = 2, max_iters = 20000,
  eval_interval = 0, log_interval = 1, sample_length = 0, warmup_iters = 0, device = 'cpu',
  peak_flops = 1e12, dropout = 0, bias = false, seed = 3, keep_last = 2,
  build_data = function(cfg, rank, world)
    local f = assert(io.open(('%s/pid.%d'):format(cfg.out_dir, rank), 'wb'))
    f:write(tostring(require('gptlua.dist.launch').getpid()))
    f:close()
    return train.build_data(cfg, rank, world)
  end,
}
