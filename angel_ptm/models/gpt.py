"""A GPT / LLaMA-style decoder-only transformer as a plain ``nn.Module``.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU feed-forward, in one file you can
read top to bottom. There is deliberately no paging, sharding or memory code here: the runtime applies those
from outside, the way torchtitan's ``parallelize_*`` functions do.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from angel_ptm.errors import ConfigTypeError, ConfigValueError


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # None = n_head; fewer = grouped-query attention
    dim: int = 256
    ffn_hidden: Optional[int] = None  # None = LLaMA rule, see hidden_dim
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    dropout: float = 0.0  # on the embeddings, the attention probabilities and each residual branch (training only)
    moe: Optional[dict] = None  # None: dense; else models/moe.py's settings (moe_settings: `every` and MoESpec)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "dim", "n_kv_head", "ffn_hidden"):
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigTypeError(f"model.{key} must be an integer, got {value!r}")
            if value <= 0:
                raise ConfigValueError(f"model.{key} must be > 0, got {value}")
        if self.dim % self.n_head != 0:
            raise ConfigValueError(f"model.dim ({self.dim}) must be divisible by model.n_head ({self.n_head})")
        if self.n_head % self.kv_heads != 0:
            raise ConfigValueError(
                f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigValueError(
                f"head dim model.dim / model.n_head = {self.head_dim} must be even for rotary embeddings"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real):
            raise ConfigTypeError(f"model.dropout must be a number, got {self.dropout!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.moe is not None:
            from angel_ptm.models.moe import check_every, moe_settings

            self.moe = moe_settings(self.moe)
            check_every(self.moe, self.n_layer)
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigValueError(
                f"model.rope_theta ({self.rope_theta}), model.norm_eps ({self.norm_eps}) and "
                f"model.init_std ({self.init_std}) must be > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-int(8 * self.dim / 3) // 64) * 64  # LLaMA: 8/3 * dim, rounded up to a multiple of 64

    @classmethod
    def from_mapping(cls, obj: Any) -> "GPTConfig":
        """Build from a dict or any object with (a subset of) the field names; other keys such as ``name``
        are ignored, missing ones take the defaults."""
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(obj, dict):
            values = {k: obj[k] for k in names if k in obj}
        else:
            values = {k: getattr(obj, k) for k in names if hasattr(obj, k)}
        return cls(**values)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: the mean of squares under- or overflows in fp16/bf16.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables. Non-persistent buffers: derived from the config, so they stay out of
    checkpoints and out of anything the runtime pages."""

    def __init__(self, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.outer(torch.arange(self.seq_len, dtype=torch.float32), inv_freq)  # [seq, head_dim/2]
        return angles.cos(), angles.sin()

    def reset_buffers(self) -> None:
        """Recompute the tables in place (after materialising a model built on the meta device)."""
        cos, sin = self._tables()
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape [batch, heads, seq, head_dim] (rotate-half / GPT-NeoX pairing)."""
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)
        self.dropout = float(cfg.dropout)  # of the attention probabilities

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        if self.n_kv_head != self.n_head:  # grouped-query: each kv head serves n_head / n_kv_head query heads
            repeats = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe_spec=None, token_ids=None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if moe_spec is None:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)
        else:  # each expert a SwiGLU of the dense width (models/moe.py)
            from angel_ptm.models.moe import MoE

            self.feed_forward = MoE(cfg.dim, cfg.hidden_dim, moe_spec,
                                    make_expert=lambda: FeedForward(cfg.dim, cfg.hidden_dim), token_ids=token_ids)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.resid_dropout(self.attention(self.attention_norm(x), rope))
        return x + self.resid_dropout(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.token_ids = None  # the ids of the forward in progress, for hash gates (a models.gates.TokenIds)
        spec, every = None, 0
        if cfg.moe is not None:
            from angel_ptm.models.gates import TokenIds
            from angel_ptm.models.moe import MoESpec

            self.token_ids = TokenIds()
            spec = MoESpec(**{k: v for k, v in cfg.moe.items() if k != "every"})
            every = cfg.moe["every"]
        self.layers = nn.ModuleList(Block(cfg, spec if every and (i + 1) % every == 0 else None, self.token_ids)
                                    for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given torch's global RNG: N(0, init_std) for every Linear / Embedding weight, with the
        residual-branch output projections (wo, w2) scaled by 1/sqrt(2 * n_layer) as in GPT-2; norms = 1."""
        seen: set[int] = set()
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) in seen:  # tied output weight: initialised once, as the embedding
                    continue
                seen.add(id(module.weight))
            self.init_module(name, module)
        self.rope.reset_buffers()

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """The init_weights rule for the parameters `module` (called `name` in this model) owns directly.

        init_weights applies it to every module in turn; a runtime that materialises a model built on the meta
        device applies it to one module at a time, in the same order, so it draws the same random numbers."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = 1 / math.sqrt(2 * self.cfg.n_layer) if name.endswith((".wo", ".w2")) else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std * scale)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif hasattr(module, "reset_buffers"):  # a gate's schedule position (DTS)
            module.reset_buffers()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] for token ids ``idx`` [batch, seq]; with ``targets`` the mean
        cross-entropy loss (a scalar) instead."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigValueError(f"input length {t} exceeds model.seq_len ({self.cfg.seq_len})")
        if self.token_ids is not None:
            self.token_ids.ids = idx.reshape(-1)
        h = self.drop(self.tok_embeddings(idx))
        for layer in self.layers:
            h = layer(h, self.rope)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return loss + self.aux_loss() if self.cfg.moe is not None else loss

    def aux_loss(self) -> torch.Tensor:
        """The MoE layers' weighted auxiliary losses of the last forward (0 for a dense model)."""
        return sum((layer.feed_forward.aux_loss for layer in self.layers if hasattr(layer.feed_forward, "gate")),
                   torch.zeros(()))

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding/output weight is counted once)."""
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True)
class ActivationFootprint:
    """Saved-for-backward bytes of one micro-batch: the most on the compute device at once (`device`, outside
    the page pools) and the most in activation pages at once (`paged`, with activations.offload)."""

    device: int
    paged: int = 0


def activation_footprint(cfg: GPTConfig, batch_size: int, dtype_bytes: int = 4, checkpoint: str = "none",
                         offload: bool = False, offload_min_bytes: int = 0, tp: int = 1,
                         sequence_parallel: bool = False) -> ActivationFootprint:
    """The activations one training step of this GPT saves for backward, per activations setting, as the binder
    measures them (each storage once; tools.bench.activations and tests/test_activations.py check it). Without
    dropout: a GPT with `dropout` (its masks, and the attention kernel it needs) is traced instead
    (activations/source.py).

    Per token, in elements of ``dtype_bytes`` (d = dim, q = n_head * head_dim, kv = n_kv_head * head_dim,
    h = hidden_dim), with a fused attention kernel (flash / memory-efficient, or its CPU counterpart):
      every saved tensor of a block (``keep``): 6d (the two norms' inputs as float32, normalized values and
        outputs) + 5q
        (q, k and v after rope -- k and v repeated to n_head heads under grouped-query attention -- the attention
        output and its transposed copy fed to wo) + 4h
        (w1 and w3 outputs, silu(w1 x), the product fed to w2), plus two float32 norm statistics and n_head float32
        log-sum-exps;
      the root: the final norm (3d, its input as float32, and a float32 statistic), the float32 log-softmax of the logits (vocab) and the
        int64 token ids and targets.
    checkpoint full: a block keeps its input (d) and its recomputation rebuilds the rest (keep - d), one block at
    a time; selective keeps, besides its input, the outputs of its matrix products and of the attention kernel:
    3d + 2q + 2kv + 2h and the log-sum-exps. The peak is the end of forward or the recomputation of the last block,
    whichever is larger. With offload, every saved tensor of at least `offload_min_bytes` goes into pages: all of
    them without checkpointing; under it, each block's input (what the selective policy keeps stays with it).

    One rank of tensor parallelism (`tp`, angel_ptm/parallel/tensor): q, kv, h, the heads and the vocabulary are
    split (the vocabulary-parallel loss keeps its softmax share, a gathered index and two masks per token); the
    d-wide tensors stay whole, except with sequence parallelism, where the norms' inputs, normalized values and
    statistics and each block's input are sequence shards (1/tp) and the linears keep the gathered inputs (whole:
    two per block, one before the output head); selective recomputation also keeps the row-parallel products
    (whole, before their reduction).
    """
    tokens = batch_size * cfg.seq_len
    d, h, heads, dt = cfg.dim, cfg.hidden_dim // tp, cfg.n_head // tp, dtype_bytes
    q, kv = cfg.n_head * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp
    s = tp if sequence_parallel else 1  # the residual stream's share of the sequence
    # (bytes per token of one tensor, how many such tensors)
    # k and v as the attention kernel gets them: repeated to n_head heads under grouped-query attention
    # The norms compute in float32: each keeps its input as float32 (the input itself in fp32, else a copy).
    if s == 1:  # the norms' outputs are what the linears keep
        block_keep = [(d * 4, 2), (d * dt, 4), (q * dt, 5), (h * dt, 4), (4, 2), (heads * 4, 1)]
        root = [(d * 4, 1), (d * dt, 2), (4, 1)]
    else:  # the norms on shards; the linears keep the gathered inputs
        block_keep = [(d * 4 / s, 2), (d * dt / s, 2), (d * dt, 2), (q * dt, 5), (h * dt, 4), (4 / s, 2),
                      (heads * 4, 1)]
        root = [(d * 4 / s, 1), (d * dt / s, 1), (d * dt, 1), (4 / s, 1)]
    # input included; the row-parallel products are whole before their reduction
    selective_keep = [(d * dt / s, 1), (d * dt, 2), (q * dt, 2), (kv * dt, 2), (h * dt, 2), (heads * 4, 1)]
    root += [(cfg.vocab_size * 4 / tp, 1), (8, 2)]  # the log-softmax (tp: the softmax share), float32; ids, targets
    if tp > 1:
        root += [(8, 1), (1, 2)]  # the vocabulary-parallel loss's clamped index and its masks

    def paged(nbytes: int) -> bool:
        return offload and nbytes >= max(1, offload_min_bytes)

    def split(groups) -> tuple[int, int]:
        """(bytes kept on the device, bytes in pages) of these saved tensors."""
        device = paged_bytes = 0
        for size, count in groups:
            nbytes = int(tokens * size)
            if paged(nbytes):
                paged_bytes += count * nbytes
            else:
                device += count * nbytes
        return device, paged_bytes

    n = cfg.n_layer
    root_device, root_paged = split(root)
    if checkpoint == "none":
        block_device, block_paged = split(block_keep)
        return ActivationFootprint(n * block_device + root_device, n * block_paged + root_paged)
    boundary = tokens * d * dt // s  # a checkpointed block's input, saved through the binder's hooks
    boundary_paged = paged(boundary)
    # What the selective policy keeps besides the input stays with it; a recomputation rebuilds the rest on the
    # device, one block at a time.
    inside = int(tokens * sum(size * count for size, count in selective_keep)) - boundary \
        if checkpoint == "selective" else 0
    # The block's input is among what it saves only in float32 (else the norm's float32 copy is)
    rebuilt = int(tokens * sum(size * count for size, count in block_keep)) - (boundary if dt == 4 else 0)
    per_block = inside + (0 if boundary_paged else boundary)
    end_of_forward = n * per_block + root_device
    last_block = (n - 1) * per_block + rebuilt
    return ActivationFootprint(max(end_of_forward, last_block), n * boundary * boundary_paged + root_paged)


def estimate_activation_bytes(cfg: GPTConfig, batch_size: int, dtype_bytes: int = 4, recompute: bool = False) -> int:
    """The device-side activation peak without offload (activation_footprint), with or without full
    recomputation."""
    return activation_footprint(cfg, batch_size, dtype_bytes, "full" if recompute else "none").device
