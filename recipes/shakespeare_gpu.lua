-- nanoGPT's "baby GPT" on tiny Shakespeare (config/train_shakespeare_char.py):
-- 6 layers, 6 heads, width 384, context 256, batch 64, 5000 iterations,
-- dropout 0.2, lr 1e-3 -> 1e-4, float32.  For a GPU; not yet timed on one
-- (nanoGPT reports about 3 minutes on an A100 and val loss about 1.47 for
-- this configuration).  On a CPU it takes hours.
return {
  name = 'shakespeare_gpu', model = 'gpt2', bias = false,
  data = 'char', data_path = 'data/tinyshakespeare.txt', val_fraction = 0.1,
  n_layer = 6, n_head = 6, n_embd = 384, block_size = 256, dropout = 0.2,
  batch_size = 64, gradient_accumulation_steps = 1,
  learning_rate = 1e-3, min_lr = 1e-4, beta2 = 0.99, weight_decay = 0.1, grad_clip = 1.0,
  warmup_iters = 100, lr_decay_iters = 5000, max_iters = 5000,
  eval_interval = 250, eval_iters = 200, log_interval = 10, sample_length = 500,
  device = 'auto', dtype = 'float32', seed = 1337,
}
