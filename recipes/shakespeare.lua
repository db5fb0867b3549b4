-- The default recipe (`make run`): a character-level GPT on tiny Shakespeare
-- at nanoGPT's CPU configuration (config/train_shakespeare_char.py with
-- nanoGPT's CPU command): 4 layers, 4 heads, width 128, context 64, batch 12,
-- 2000 iterations, AdamW lr 1e-3 (beta2 0.99, weight decay 0.1 on matrices,
-- clip 1.0) with 100 warmup steps and cosine decay to 1e-4.  Target: val
-- loss <= 1.88, nanoGPT's figure for this configuration.
--
-- The block is nanochat's (rotary positions, parameter-free RMSNorm, QK-norm,
-- ReLU^2 MLP, untied head): with the same parameter count and optimizer, and
-- about 15% more time per step on a CPU, it ends at val loss 1.72 (three
-- seeds: 1.717-1.720; 1.723-1.724 over the whole val split).
-- nanoGPT's own GPT-2 block is `--model=gpt2`: it ends at 1.90-1.91 in
-- gptlua and 1.90-1.92 in PyTorch (recipes/bench_torch_gpt.py --train),
-- whose losses gptlua's match step for step (recipes/compare_torch.lua).
return {
  name = 'shakespeare',
  model = 'nanochat',
  data = 'char', data_path = 'data/tinyshakespeare.txt', val_fraction = 0.1,
  n_layer = 4, n_head = 4, n_embd = 128, block_size = 64, dropout = 0.0, bias = false,
  batch_size = 12, gradient_accumulation_steps = 1,
  optimizer = 'adamw', learning_rate = 1e-3, min_lr = 1e-4, beta1 = 0.9, beta2 = 0.99,
  weight_decay = 0.1, grad_clip = 1.0,
  warmup_iters = 100, lr_decay_iters = 2000, max_iters = 2000,
  eval_interval = 250, eval_iters = 50, log_interval = 50,
  sample_length = 500, temperature = 0.8, top_k = 200,
  device = 'auto', seed = 1337,
}
