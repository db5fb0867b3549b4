-- The default recipe (`make run`): a character-level GPT on tiny Shakespeare,
-- 1175 steps, about 1.5 minutes on a 2-core x86 CPU; it ends near val loss
-- 1.63.  Sizes are nanoGPT's CPU configuration of
-- config/train_shakespeare_char.py (4 layers, 4 heads, width 128, context
-- 64, batch 12); the block is nanochat's first release
-- (gptlua.models.nanochat v1: rotary positions, parameter-free RMSNorm,
-- QK-norm, ReLU^2 MLP, untied head); the optimizer is nanochat's (Muon lr
-- 0.02 for the block matrices, AdamW for the embedding and head), cosine to
-- 10% after 59 warmup steps, Muon's momentum 0.85 -> 0.95 over the first 15%
-- of the steps.  --optimizer=adamw trains with AdamW instead, --model=gpt2
-- with nanoGPT's GPT-2 block, --nanochat.version=v2 with nanochat's newer
-- block: README.md, "Measured results", compares them.
local optim = require 'gptlua.optim'
return {
  name = 'shakespeare',
  model = 'nanochat',
  data = 'char', data_path = 'data/tinyshakespeare.txt', val_fraction = 0.1,
  n_layer = 4, n_head = 4, n_embd = 128, block_size = 64, dropout = 0.0, bias = false,
  batch_size = 12, gradient_accumulation_steps = 1,
  -- the groups' peak rates (the trainer's defaults, written out: --help says what each is); the cosine
  -- ends at final_lr_frac of each.  --optimizer=adamw takes the trainer's AdamW defaults instead
  -- (learning_rate 1e-3, min_lr 1e-4, beta2 0.99, weight_decay 0.1)
  optimizer = 'nanochat', matrix_lr = 0.02, embedding_lr = 0.2, unembedding_lr = 0.004, final_lr_frac = 0.1,
  grad_clip = 1.0,
  warmup_iters = 59, lr_decay_iters = 1175, max_iters = 1175,
  momentum_schedule = function(cfg) return optim.schedules.muon_momentum(0.85, 0.95, math.floor(0.15 * cfg.max_iters)) end,
  eval_interval = 235, eval_iters = 50, log_interval = 50,
  sample_length = 500, temperature = 0.8, top_k = 200,
  device = 'auto', seed = 1337,
}
