"""A toy paged-KV inference engine on HuggingFace transformers (no kvxfer in here).

What a real engine has, in miniature: model weights (a tiny random-weight Qwen2 built
locally, fp32, no model hub), one KV pool per layer shaped
``(2, num_blocks, block_size, kv_heads, head_dim)`` (K and V, vLLM's layout), a block
allocator whose free list is shuffled (so a prompt lands in different block ids on two
instances), and a forward pass that writes each token's K/V into its block slot and
attends over the request's blocks. :mod:`disagg` adds kvxfer around it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BLOCK_SIZE = 16
NUM_BLOCKS = 64


def build_model(seed: int = 0) -> Qwen2ForCausalLM:
    """The same random weights in every process that calls this with the same seed.

    A wide init range (0.2) keeps greedy output prompt-dependent: near-zero weights
    collapse into a short cycle, which would let a broken KV transfer pass unnoticed.
    """
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    return model


@dataclass
class Sequence:
    """One request as the engine tracks it: its tokens and the blocks holding their KV."""

    request_id: str
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)


class ToyEngine:
    """Paged KV cache + forward pass. Single request at a time, CPU, fp32."""

    def __init__(self, model: Qwen2ForCausalLM, *, num_blocks: int = NUM_BLOCKS, seed: int = 1):
        cfg = model.config
        self.model = model
        self.block_size = BLOCK_SIZE
        self.kv_heads = cfg.num_key_value_heads
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        # One pool per layer; they must stay alive (and in place) as long as kvxfer
        # has them registered: the engine owns them for its whole life.
        self.kv_caches = [
            torch.zeros(2, num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    # -- block allocator ---------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens."""
        while len(seq.blocks) < self.blocks_for(num_tokens):
            seq.blocks.append(self.free.pop())

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    # -- forward ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seq: Sequence, start: int) -> int:
        """Run tokens ``seq.tokens[start:]`` (their KV goes into ``seq.blocks``), attending
        over positions ``0..len(tokens)``; returns the greedy next token."""
        m = self.model.model
        ids = torch.tensor(seq.tokens[start:])
        positions = torch.arange(start, len(seq.tokens))
        n_new, n_all = len(ids), len(seq.tokens)
        hidden = m.embed_tokens(ids)[None]  # (1, n_new, hidden)
        cos, sin = m.rotary_emb(hidden, positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # (n_new, 1, head_dim)
        block_of = torch.tensor(seq.blocks)[positions // self.block_size]
        slot_of = positions % self.block_size
        all_pos = torch.arange(n_all)
        all_blocks = torch.tensor(seq.blocks)[all_pos // self.block_size]
        all_slots = all_pos % self.block_size
        mask = all_pos[None, :] <= positions[:, None]  # causal: (n_new, n_all)
        for layer, cache in zip(m.layers, self.kv_caches):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)[0]
            q = attn.q_proj(x).view(n_new, self.heads, self.head_dim)
            k = attn.k_proj(x).view(n_new, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(n_new, self.kv_heads, self.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache[0, block_of, slot_of] = k  # write this step's KV into its blocks
            cache[1, block_of, slot_of] = v
            keys = cache[0, all_blocks, all_slots]  # gather the request's KV: (n_all, kvh, d)
            values = cache[1, all_blocks, all_slots]
            rep = self.heads // self.kv_heads
            keys = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # (heads, n_all, d)
            values = values.repeat_interleave(rep, dim=1).transpose(0, 1)
            scores = q.transpose(0, 1) @ keys.transpose(1, 2) * attn.scaling
            scores = scores.masked_fill(~mask[None], float("-inf"))
            out = (scores.softmax(-1) @ values).transpose(0, 1).reshape(n_new, -1)
            hidden = hidden + attn.o_proj(out)[None]
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(m.norm(hidden))[0, -1]
        return int(logits.argmax())

    def prefill(self, seq: Sequence) -> int:
        """Allocate blocks for the prompt, fill their KV; return the first output token."""
        self.allocate(seq, len(seq.tokens))
        return self.forward(seq, 0)

    def decode(self, seq: Sequence, first: int, steps: int) -> list[int]:
        """Greedy-decode ``steps`` tokens after ``first`` from the KV already in
        ``seq.blocks`` (filled by our prefill, or by kvxfer from another instance)."""
        out = [first]
        for _ in range(steps):
            seq.tokens.append(out[-1])
            self.allocate(seq, len(seq.tokens))
            out.append(self.forward(seq, len(seq.tokens) - 1))
        return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.no_grad()
def hf_greedy(model: Qwen2ForCausalLM, prompt: list[int], steps: int) -> list[int]:
    """transformers' own forward, no cache, full recompute each step: checks the engine."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(steps + 1):
        logits = model(torch.tensor([tokens])).logits[0, -1]
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
    return out
