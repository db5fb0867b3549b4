-- Run by spec/dist_launch_spec.lua as `gptlua -n 2 spec/dist/launch_recipe.lua
-- --out_dir=DIR [--key=value]`: a tiny recipe that trains 2 steps, so the
-- spec sees the banner, which policy ran and where it wrote.  With
-- GPTLUA_SPEC_SLEEP_RANK=R rank R never reaches the policy's first
-- collective (it sleeps in build_data), so the others hit dist_timeout.
local train = require 'gptlua.train'
return {
  name = 'launch', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
  n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, batch_size = 2, max_iters = 2,
  eval_interval = 0, log_interval = 1, sample_length = 0, warmup_iters = 0, device = 'cpu',
  peak_flops = 1e12, dropout = 0, bias = false, seed = 3,
  build_data = function(cfg, rank, world)
    if tostring(rank) == os.getenv('GPTLUA_SPEC_SLEEP_RANK') then
      local ffi = require 'ffi'
      ffi.cdef 'int poll(void *fds, unsigned long nfds, int timeout);'
      -- asleep in-process, so nothing outlives the abort; longer than the
      -- spec's time limit, so a sleeper the abort misses shows as that limit
      ffi.C.poll(nil, 0, 300000)
    end
    return train.build_data(cfg, rank, world)
  end,
}
