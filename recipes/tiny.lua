-- recipes/tiny.lua: a 2-layer char model with a custom schedule
local optim = require 'gptlua.optim'
return {
  name = 'tiny',
  model = 'gpt2',                      -- or 'nanochat' (depth = N, or n_layer/n_head/n_embd)
  data = 'char', data_path = 'data/tinyshakespeare.txt', val_fraction = 0.1,
  n_layer = 2, n_head = 2, n_embd = 64, block_size = 32, dropout = 0.0,
  batch_size = 16, gradient_accumulation_steps = 2,
  optimizer = 'adamw', learning_rate = 2e-3, beta2 = 0.99, weight_decay = 0.1, grad_clip = 1.0,
  max_iters = 500, eval_interval = 100, eval_iters = 20, log_interval = 20,
  checkpoint_interval = 250, keep_last = 2, sample_length = 200,
  device = 'auto', seed = 1337,
  -- a hook: the learning-rate multiplier as a function of the step
  lr_schedule = function(cfg) return optim.schedules.wsd(20, cfg.max_iters, 0.3, 0.1) end,
}
