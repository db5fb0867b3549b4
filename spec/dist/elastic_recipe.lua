-- A tiny recipe for the failure specs (spec/checkpoint_async_spec.lua,
-- spec/elastic_spec.lua): it trains max_iters steps on the CPU with a
-- checkpoint every checkpoint_interval steps, on one rank or several
-- (`gptlua -n N`), with the launcher's test hooks given on the command line.
return {
  name = 'elastic', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
  n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, batch_size = 4, max_iters = 8,
  eval_interval = 0, log_interval = 1, sample_length = 0, warmup_iters = 0, device = 'cpu',
  peak_flops = 1e12, dropout = 0, bias = false, seed = 3, checkpoint_interval = 2, keep_last = 0,
  tensorboard = false, control = false,
}
