-- nanochat's d20 base model: depth 20 (width 1280, 10 heads of 128), context
-- 2048, device batch 32, 21400 steps of 0.5M tokens (11B tokens), Muon for
-- the block matrices and AdamW for embeddings and head, warmup-stable-decay
-- schedule, bf16.  For GPUs: about 23 hours (19 to 29) on one H100 by the
-- account's prediction (recipes/tools/ACCOUNT.md; no GPU has timed it yet).  Token data as
-- for gpt2_124m.lua; --data=random benchmarks without data.
return {
  name = 'nanochat_d20', model = 'nanochat', depth = 20, softcap = 15,
  data = 'shards', data_dir = 'data/fineweb', tokenizer = 'data/fineweb/tokenizer.tiktoken', vocab_size = 65536,
  block_size = 2048, batch_size = 32, total_batch_size = 524288,
  optimizer = 'nanochat', matrix_lr = 0.02, embedding_lr = 0.2, unembedding_lr = 0.004, grad_clip = 1.0,
  schedule = 'wsd', warmup_iters = 0, cooldown_frac = 0.2, max_iters = 21400,
  eval_interval = 250, eval_iters = 20, log_interval = 10, sample_length = 200, checkpoint_interval = 2000,
  device = 'auto', dtype = 'bfloat16', seed = 1337,
}
