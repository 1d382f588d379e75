"""Decode caches and per-step metadata for the stock decoder, with the checks a step runs first."""

from __future__ import annotations

import dataclasses

import torch

from .config import K3Config
from .reference.common import fp8_pow2_quantize

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class LayerCache:
    """One layer's caches; the fields of the other attention kind are None."""

    conv_state: torch.Tensor | None = None  # KDA: [S, W-1, 3*H*D] BF16
    recurrent_state: torch.Tensor | None = None  # KDA: [S, H, D(v), D(k)] FP32
    kv_cache: torch.Tensor | None = None  # MLA/DSA: [NB, BS, kv_lora + rope] BF16, or FP8 e4m3 (config.latent_fp8)
    index_cache: torch.Tensor | None = None  # DSA: [NB, BS, Di] FP8 e4m3
    index_scale: torch.Tensor | None = None  # DSA: [NB, BS] FP32 (power-of-two scales)
    kv_scale: torch.Tensor | None = None  # MLA/DSA with an FP8 latent cache: [NB, BS] FP32 (power-of-two scales)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass
class KimiCache:
    """Every layer's caches: ``num_slots`` request states and ``num_blocks`` paged blocks."""

    layers: list[LayerCache]
    num_slots: int
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls, config: K3Config, num_slots: int, num_blocks: int, block_size: int = 16,
        device: str | torch.device = "cpu", pooled: bool = False, seed: int | None = 0,
    ) -> "KimiCache":
        """Allocate caches, filled with random data (never zeros) when ``seed`` is set.

        The latent cache follows ``config.latent_cache_dtype``: FP8 rows are seeded as the
        quantized random BF16 rows, with their power-of-two scales in ``kv_scale``.
        ``pooled=True`` makes each cache a strided view into one pool per kind, shared by all
        layers (layers interleaved inside each block / slot), as paged serving engines lay them out.
        """
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        kinds = [config.layer_kind(i) for i in range(config.num_layers)]
        n_kda = kinds.count("kda")
        n_att = len(kinds) - n_kda
        n_dsa = kinds.count("dsa")
        H, D, W = config.kda_heads, config.kda_head_dim, config.kda_conv_width

        def make(shape, dtype, count, layer_dim, device=device, pooled=pooled):
            # One pool with the layer index at ``layer_dim`` (plus a spare layer 0, so views
            # have a storage offset); pooled caches are its strided views on ``device``, others
            # their copies, each made there from the host pool (no device pool: no 2x peak).
            full = list(shape)
            full.insert(layer_dim, count + 1)
            t = torch.randn(full, generator=g) if g is not None else torch.empty(full)
            t = (t * 0.5).to(dtype) if dtype != FP8 else t.mul(4).clamp(-8, 8).to(FP8)
            if pooled:
                t = t.to(device)
            views = [t.select(layer_dim, j + 1) for j in range(count)]
            return views if pooled else [v.to(device, copy=True) for v in views]

        conv = make((num_slots, W - 1, 3 * H * D), torch.bfloat16, n_kda, 1)
        rec = make((num_slots, H, D, D), torch.float32, n_kda, 1)
        latent = (num_blocks, block_size, config.latent_dim)
        if not config.latent_fp8:
            kv = make(latent, torch.bfloat16, n_att, 1)
        else:  # seeded as the quantized BF16 draws, drawn here (the other caches' draws stay as they are), on the CPU
            kv = make(latent, torch.bfloat16, n_att, 1, "cpu", False) if g is not None else []
        idx = make((num_blocks, block_size, config.index_head_dim), FP8, n_dsa, 1)
        scl = make((num_blocks, block_size), torch.float32, n_dsa, 1)
        for s in scl:
            s.abs_().add_(0.01)  # scales are positive
        if config.latent_fp8:  # pools made last: the BF16 caches' random draws are unchanged
            kv8 = make(latent, FP8, n_att, 1)
            kvs = make((num_blocks, block_size), torch.float32, n_att, 1)
            if g is not None:
                for rows, values, scale in zip(kv, kv8, kvs):
                    v, s = fp8_pow2_quantize(rows.to(device))
                    values.copy_(v)
                    scale.copy_(s)
            kv = list(zip(kv8, kvs))
        else:
            kv = [(t, None) for t in kv]
        layers = []
        for kind in kinds:
            if kind == "kda":
                layers.append(LayerCache(conv_state=conv.pop(0), recurrent_state=rec.pop(0)))
            elif kind == "mla":
                kv_cache, kv_scale = kv.pop(0)
                layers.append(LayerCache(kv_cache=kv_cache, kv_scale=kv_scale))
            else:
                kv_cache, kv_scale = kv.pop(0)
                layers.append(LayerCache(kv_cache=kv_cache, index_cache=idx.pop(0), index_scale=scl.pop(0),
                                         kv_scale=kv_scale))
        return cls(layers, num_slots, num_blocks, block_size).mark_static()

    def mark_static(self) -> "KimiCache":
        """Give every cache tensor a static address for torch.compile; returns self.

        The ops mutate the caches in place, and cudagraph trees (``mode="reduce-overhead"``)
        graph a step that mutates its inputs only when those inputs are static: unguarded, so a
        step on another cache re-records the graph instead of recompiling.
        """
        for lc in self.layers:
            for t in lc.tensors().values():
                torch._dynamo.mark_static_address(t, guard=False)
        return self

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every cache tensor, keyed ``layer.<i>.<name>``."""
        return {f"layer.{i}.{n}": t.clone() for i, lc in enumerate(self.layers) for n, t in lc.tensors().items()}

    def clone(self) -> "KimiCache":
        """A deep copy (pooled views become plain tensors)."""
        return KimiCache([LayerCache(**{n: t.clone() for n, t in lc.tensors().items()}) for lc in self.layers],
                         self.num_slots, self.num_blocks, self.block_size).mark_static()


@dataclasses.dataclass
class StepMeta:
    """Per-step metadata: B requests of ``q_len`` tokens each (q_len = 1: decode; > 1: verify)."""

    q_len: int
    slot_mapping: torch.Tensor  # [B*q_len] int64, flat cache slot per token, -1 = padding
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    state_indices: torch.Tensor  # [B] int32, KDA state slot per request, -1 = padding
    accepted: torch.Tensor  # [B] int32 in 1..q_len: tokens whose KDA state is committed

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]


class StepError(ValueError):
    """A decode step's inputs are malformed; raised before any cache is touched."""


def check_step(config: K3Config, input_ids: torch.Tensor, meta: StepMeta, cache: KimiCache) -> None:
    """Validate a step's inputs (dtypes, shapes, ranges) against the config and the cache."""
    def need(cond, msg):
        if not cond:
            raise StepError(msg)

    B, q = meta.num_requests, meta.q_len
    need(isinstance(q, int) and not isinstance(q, bool) and q >= 1, f"q_len must be a positive int, got {q!r}")
    need(input_ids.dtype in (torch.int32, torch.int64), f"input_ids must be int32/int64, got {input_ids.dtype}")
    need(input_ids.dim() == 1 and input_ids.shape[0] == B * q,
         f"input_ids must be [B*q_len] = [{B * q}], got {list(input_ids.shape)}")
    for name, dtypes, shape in (
        ("slot_mapping", (torch.int64, torch.int32), [B * q]),
        ("seq_lens", (torch.int32, torch.int64), [B]),
        ("state_indices", (torch.int32, torch.int64), [B]),
        ("accepted", (torch.int32, torch.int64), [B]),
    ):
        t = getattr(meta, name)
        need(t.dtype in dtypes, f"meta.{name} must be one of {dtypes}, got {t.dtype}")
        need(list(t.shape) == shape, f"meta.{name} must have shape {shape}, got {list(t.shape)}")
    bt = meta.block_table
    need(bt.dtype in (torch.int32, torch.int64), f"meta.block_table must be int32/int64, got {bt.dtype}")
    need(bt.dim() == 2 and bt.shape[0] == B, f"meta.block_table must be [B={B}, max_blocks], got {list(bt.shape)}")
    need(bool(((input_ids >= 0) & (input_ids < config.vocab_size)).all()),
         f"input_ids out of range [0, {config.vocab_size})")
    n_slots = cache.num_blocks * cache.block_size
    sm = meta.slot_mapping
    need(bool(((sm >= -1) & (sm < n_slots)).all()), f"meta.slot_mapping out of range [-1, {n_slots})")
    si = meta.state_indices
    need(bool(((si >= -1) & (si < cache.num_slots)).all()), f"meta.state_indices out of range [-1, {cache.num_slots})")
    live = si[si >= 0]
    need(live.unique().numel() == live.numel(), "meta.state_indices repeat a state slot (two requests, one KDA state)")
    used = sm[sm >= 0]
    need(used.unique().numel() == used.numel(), "meta.slot_mapping repeats a cache slot (two tokens, one entry)")
    need(bool(((meta.accepted >= 1) & (meta.accepted <= q)).all()), f"meta.accepted must lie in [1, q_len={q}]")
    need(bool((meta.seq_lens >= q).all()), f"meta.seq_lens must be >= q_len={q}")
    need(bool((meta.seq_lens <= bt.shape[1] * cache.block_size).all()),
         f"meta.seq_lens exceed the block table's capacity {bt.shape[1] * cache.block_size}")
    need(bool(((bt >= 0) & (bt < cache.num_blocks)).all()), f"meta.block_table entries out of range [0, {cache.num_blocks})")
    need(len(cache.layers) == config.num_layers, f"cache has {len(cache.layers)} layers, config {config.num_layers}")
    for i, lc in enumerate(cache.layers):
        if lc.kv_cache is not None:  # the latent cache in the config's format (FP8: with its scales)
            fp8 = lc.kv_scale is not None
            need(fp8 == config.latent_fp8 and lc.kv_cache.dtype == (FP8 if fp8 else torch.bfloat16),
                 f"layer {i}: latent cache {lc.kv_cache.dtype} ({'with' if fp8 else 'without'} kv_scale) is not "
                 f"the config's {config.latent_cache_dtype}")


class RequestBatch:
    """B live requests with their state slots and blocks; produces each step's metadata."""

    def __init__(self, cache: KimiCache, num_requests: int, start_len: int = 0, device="cpu", seed: int = 0,
                 padding: int = 0):
        """Requests 0..B-1 get state slots and disjoint, shuffled block lists; the last ``padding``
        requests are padding (state index -1, slot -1)."""
        g = torch.Generator().manual_seed(seed)
        self.cache, self.B, self.device, self.padding = cache, num_requests, device, padding
        per_req = cache.num_blocks // num_requests
        perm = torch.randperm(cache.num_blocks, generator=g)[: per_req * num_requests]
        self.block_table = perm.view(num_requests, per_req).to(torch.int32)
        self.state_slots = torch.randperm(cache.num_slots, generator=g)[:num_requests].to(torch.int32)
        self.lens = torch.full((num_requests,), start_len, dtype=torch.int32)

    def step(self, q_len: int = 1, accepted: list[int] | torch.Tensor | None = None) -> StepMeta:
        """Metadata for the next step of ``q_len`` tokens per request (advances by ``accepted``)."""
        B, bs = self.B, self.cache.block_size
        seq_lens = self.lens + q_len
        pos = (seq_lens.long().view(-1, 1) - q_len + torch.arange(q_len)).view(-1)
        req = torch.arange(B).repeat_interleave(q_len)
        slots = self.block_table[req, pos // bs].long() * bs + pos % bs
        acc = torch.full((B,), q_len, dtype=torch.int32) if accepted is None else torch.as_tensor(accepted, dtype=torch.int32)
        state = self.state_slots.clone()
        if self.padding:
            state[B - self.padding:] = -1
            slots.view(B, q_len)[B - self.padding:] = -1
        self.lens = self.lens + acc
        d = self.device
        return StepMeta(q_len, slots.to(d), self.block_table.to(d), seq_lens.to(d), state.to(d), acc.to(d))


FP8_REL = 0.13  # one e4m3 step (<= 1/8 of the value) plus rounding


def max_cache_difference(got: "KimiCache", ref: "KimiCache") -> float:
    """The largest of :func:`cache_differences` between two caches, an FP8 step reading as 0.05."""
    return max(cache_differences(got.snapshot(), ref.snapshot(), fp8_scale=0.05 / FP8_REL).values())


def cache_differences(got: dict, ref: dict, fp8_scale: float = 1.0) -> dict[str, float]:
    """Max abs difference per cache tensor of two ``KimiCache.snapshot()``s.

    FP8 index keys and FP8 latent rows are compared dequantized (values x scale), as a fraction
    of each token's amax, times ``fp8_scale``: an e4m3 key moves by one step (up to 1/8 of its value,
    ``FP8_REL``) when a BF16 ulp of its input crosses a rounding boundary, and its
    power-of-two scale doubles when the amax crosses one, so raw FP8 codes are not comparable.
    """
    errs = {}
    for k, a in got.items():
        b = ref[k]
        fp8 = k.endswith("index_cache") or (k.endswith("kv_cache") and k.replace("kv_cache", "kv_scale") in got)
        if fp8:
            sk = k.replace("index_cache", "index_scale").replace("kv_cache", "kv_scale")
            da = a.float() * got[sk].unsqueeze(-1)
            db = b.float() * ref[sk].unsqueeze(-1)
            amax = torch.maximum(da.abs().amax(-1, keepdim=True), db.abs().amax(-1, keepdim=True)).clamp_min(1e-6)
            errs[k] = ((da - db).abs() / amax).max().item() * fp8_scale
        elif not k.endswith(("index_scale", "kv_scale")):  # scales are covered by the dequantized rows
            errs[k] = (a.float() - b.float()).abs().max().item()
    return errs
