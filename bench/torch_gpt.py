"""PyTorch reference for `make bench`: nanoGPT's model at the default recipe's
configuration (n_layer 4, n_head 4, n_embd 128, block 64, batch 12, dropout 0,
bias False, AdamW lr 1e-3 betas (0.9, 0.99), weight decay 0.1 on matrices,
grad clip 1.0), timed the way nanoGPT's train.py reports ms/iter.
Usage: python3 bench/torch_gpt.py ITERS THREADS [--check-loss] ; prints one JSON line."""
import json, math, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

iters, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(1337)
V, T, B, L, H, C = 65, 64, 12, 4, 4, 128

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C, elementwise_affine=True), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = [z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, 'scaled_dot_product_attention') else None
        if y is None:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // H)
            att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float('-inf'))
            y = F.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate='tanh'))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

model = GPT()
decay = [p for p in model.parameters() if p.dim() >= 2]
nodecay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': nodecay, 'weight_decay': 0.0}],
                        lr=1e-3, betas=(0.9, 0.99))
data = torch.randint(0, V, (B, T + 1))
x, y = data[:, :T], data[:, 1:]
times = []
for it in range(iters + 3):
    t0 = time.time()
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    loss.item()
    if it >= 3:
        times.append(time.time() - t0)
times.sort()
print(json.dumps({'torch': torch.__version__, 'threads': threads, 'ms_per_iter': 1000 * times[len(times) // 2],
                  'mean_ms': 1000 * sum(times) / len(times)}))
