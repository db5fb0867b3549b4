-- recipes/moe.lua: the default recipe (recipes/shakespeare.lua: nanochat's
-- block on tiny Shakespeare, characters) with a mixture of experts in every
-- block: 8 experts of hidden width 2 n_embd, each token routed to 2, so a
-- token passes through as many MLP weights as the dense model's 4 n_embd
-- MLP (the same active parameters, plus the router's 8 x n_embd per block).
-- --moe.experts=0 trains that dense model for comparison.  Routing is
-- DeepSeek-V3's: sigmoid scores, the top-2 weights normalised, balanced by
-- the auxiliary-loss-free per-expert bias, with a small Switch balancing
-- loss; --moe.router=softmax, --moe.aux_loss, --moe.capacity_factor change
-- it, and the router itself is the moe_router hook (gptlua.moe.router).
local recipe = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or './') .. 'shakespeare.lua')
recipe.name = 'moe'
recipe.moe = { experts = 8, top_k = 2, hidden = 2 * recipe.n_embd, router = 'sigmoid', bias_update = 1e-3,
               aux_loss = 1e-3, z_loss = 0, capacity_factor = 0, shared = 0, every = 1 }
return recipe
