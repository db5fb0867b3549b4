-- The nanochat / modded-nanogpt speedrun at small scale for a CPU: the
-- architecture and optimizer choices of nanochat's base_train.py (commit
-- 92d63d4, runs/speedrun.sh) on character-level tiny Shakespeare, 1000 steps
-- of 2048 tokens.  It ends near val loss 1.55 (seed 1337: 4.174 at step 0,
-- 1.940 at 200, 1.679 at 600, 1.551 at 1000); about 2.4 s a step on a
-- heavily loaded 2-core x86 VM, so up to 40 minutes there, less on a quiet one.
--
-- Model: nanochat.version = 'v2' (gptlua.models.nanochat: QK-norm with
-- scale 1.2, rotary base 100000, per-layer resid/x0 lambdas, value
-- embeddings with gates on alternate layers, smear, backout, SSSL sliding
-- windows, vocabulary padded to 64, nanochat's init), 4 layers of width 128
-- (4 heads of 32), context 256: short layers see 128 keys back, nanochat's
-- rule (a quarter of the context rounded up to 128).
-- Optimizer (setup_optimizer, gptlua.optim.nanochat with muon_variant =
-- 'current'): Muon with Polar Express, NorMuon and cautious weight decay
-- 0.28 for every block matrix (lr 0.02); AdamW (eps 1e-10) per group: head
-- lr 0.008, betas (0.8, 0.96), wd 0.01; embedding 0.3, (0.8, 0.995), wd
-- 0.001; value embeddings 0.15, (0.8, 0.995), wd 0.01; resid lambdas 0.005,
-- (0.8, 0.95), wd 0.05; x0 lambdas 0.5, (0.96, 0.95); smear/backout 0.2,
-- (0.8, 0.95); head, embedding and value-embedding rates times
-- (n_embd/768)^-0.5.
-- Schedule (base_train.py): 40 warmup steps, constant, linear warm-down over
-- the last 65% to 5% of the rate; Muon momentum 0.85 -> 0.97 over 400 steps,
-- back to 0.90 over the warm-down; no gradient clipping.
-- Deliberate differences at this scale: nanochat's batch-size rule
-- (rates times sqrt(B / 2^19), weight decay rescaled with it) is left out,
-- since at 2048 tokens per step it would cut every rate 16x; Muon's weight
-- decay stays 0.28 (nanochat also decays it to 0 on a cosine); the data is
-- characters, not FineWeb BPE tokens.
local optim = require 'gptlua.optim'

local WARMUP, WARMDOWN, FINAL = 40, 0.65, 0.05

return {
  name = 'speedrun',
  model = 'nanochat', nanochat = { version = 'v2' },
  n_layer = 4, n_head = 4, n_embd = 128, block_size = 256,
  data = 'char', data_path = 'data/tinyshakespeare.txt', val_fraction = 0.1,
  batch_size = 8, gradient_accumulation_steps = 1,
  -- nanochat's optimizer as gptlua.optim.nanochat has it (muon_variant 'current': setup_optimizer's groups)
  optimizer = 'nanochat', muon_variant = 'current', matrix_lr = 0.02, embedding_lr = 0.3, unembedding_lr = 0.008,
  muon_weight_decay = 0.28, grad_clip = 0,
  max_iters = 1000, eval_interval = 200, eval_iters = 20, log_interval = 50,
  sample_length = 300, temperature = 0.8, top_k = 200,
  device = 'auto', seed = 1337,
  -- base_train.py's lr: (it+1)/40 warmup, constant, then linear to 5% over the last 65% (= wsd)
  lr_schedule = function(cfg) return optim.schedules.wsd(WARMUP, cfg.max_iters, WARMDOWN, FINAL) end,
  momentum_schedule = function(cfg)
    local n = cfg.max_iters
    local warmdown = math.floor(WARMDOWN * n + 0.5)
    return function(it)
      if it < 400 then return 0.85 + (0.97 - 0.85) * it / 400 end
      if it >= n - warmdown then
        local progress = (it - (n - warmdown)) / warmdown
        return 0.97 * (1 - progress) + 0.90 * progress
      end
      return 0.97
    end
  end,
}
