-- GPT-2 124M as llm.c / nanoGPT train it: 19073 steps of 0.5M tokens (10B
-- tokens), context 1024, AdamW 6e-4 with cosine decay, bf16; gradient
-- accumulation fills what the device batch of 32 does not.  For GPUs: about
-- 4.7 hours (4.0 to 5.6) on one H100 by the account's prediction
-- (recipes/tools/ACCOUNT.md; no GPU has timed it yet).  Token data comes from recipes/prepare.lua shards
-- (--data=shards --data_dir=DIR --tokenizer=PATH); --data=random benchmarks
-- without data.
return {
  name = 'gpt2_124m', model = 'gpt2', bias = true,
  data = 'shards', data_dir = 'data/fineweb', tokenizer = 'data/fineweb/tokenizer.tiktoken', vocab_size = 50304,
  n_layer = 12, n_head = 12, n_embd = 768, block_size = 1024, dropout = 0.0,
  batch_size = 32, total_batch_size = 524288,
  learning_rate = 6e-4, min_lr = 6e-5, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1, grad_clip = 1.0,
  warmup_iters = 700, lr_decay_iters = 19073, max_iters = 19073,
  eval_interval = 250, eval_iters = 20, log_interval = 10, sample_length = 200, checkpoint_interval = 2000,
  device = 'auto', dtype = 'bfloat16', seed = 1337,
}
