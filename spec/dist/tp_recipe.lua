-- The small float64 GPTs the tensor-parallel specs train (spec/dist_tp_spec.lua
-- in one process, spec/dist/tp_train.lua on every rank): recipe(model, over).
-- 4 heads (nanochat: 2 KV heads) and a vocabulary of 68 (the text's 65
-- characters padded), so tp 2 and 4 divide them; a global batch of 4 rows
-- per step whatever the mesh; checkpoints every 3 steps; every step's loss
-- and gradient norm in <out_dir>/p/metrics.jsonl.
return function(model, over)
  local r = { name = 'p', model = model, data = 'char', data_path = 'data/tinyshakespeare.txt',
    n_layer = 2, n_head = 4, n_embd = 32, block_size = 16, batch_size = 1, total_batch_size = 4 * 16,
    vocab_size = 68, max_iters = 5, eval_interval = 0, log_interval = 1, sample_length = 0, warmup_iters = 2,
    lr_decay_iters = 20, quiet = true, device = 'cpu', dtype = 'float64', learning_rate = 3e-3, peak_flops = 1e12,
    dropout = 0, bias = true, seed = 7, optimizer = 'adamw', checkpoint_interval = 3, keep_last = 5,
    grad_clip = 0.5 }
  if model == 'nanochat' then r.n_kv_head = 2; r.bias = nil end
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end
