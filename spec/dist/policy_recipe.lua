-- The small GPT run the data-parallel policy specs train (spec/dist_policy_spec.lua
-- in one process, spec/dist/policy_*.lua on every rank): recipe(over) -> recipe table.
-- 'adamw' trains GPT-2 with AdamW; 'nanochat' trains the nanochat model with
-- nanochat's optimizer (Muon for the hidden matrices, AdamW for the rest).
-- Every step's loss and gradient norm go to <out_dir>/p/metrics.jsonl.  float32 on
-- every device (dtype 'auto' would be bfloat16 on a GPU): the runs are compared.
return function(over)
  local r = { name = 'p', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
    n_layer = 2, n_head = 2, n_embd = 32, block_size = 16, batch_size = 2, max_iters = 20,
    eval_interval = 0, log_interval = 1, sample_length = 0, warmup_iters = 2, lr_decay_iters = 20,
    quiet = true, device = 'cpu', dtype = 'float32', learning_rate = 3e-3, peak_flops = 1e12, dropout = 0, bias = false, seed = 7 }
  for k, v in pairs(over or {}) do r[k] = v end
  if r.optimizer == 'nanochat' then r.model = 'nanochat' end
  return r
end
