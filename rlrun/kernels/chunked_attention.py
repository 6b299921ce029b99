"""Chunked attention (CUDA; imported only where Triton is): a causal forward and a split-KV decode that sum each query
row's keys in the same chunks, so that the trainer and the embedded engine stay bitwise while the engine's decode
splits a row's keys over several thread blocks, as SGLang's decode kernels do.

Why (docs/engine.md, "How the engine keeps up with SGLang and stays exact"): the engine's decode attention was the
trainer's memory-efficient kernel, one thread block per (row, cached head) walking the row's keys in order, which leaves
the GPU idle at decode's short queries. Splitting a row's keys and merging the parts rounds differently from a trainer
that walks them in one pass, unless the trainer splits alike. Here both sides split each row's keys into chunks of
:data:`CHUNK` keys from key 0, run the same online softmax over a chunk (:func:`_chunk_partial`: tiles of
:data:`BLOCK_N` keys, the same matrix-multiply shapes) and merge the chunks in order by one formula (:func:`_merge`).
The forward (:func:`causal`) walks a row's chunks in a loop; the decode (:func:`decode`) computes them in parallel and
merges them after. A chunk past a row's last key, or a key tile past it, changes nothing in the row's sums (a merge with
-inf / 0 / 0 multiplies by exp(0) = 1 and adds 0), so the forward's longer loops give the decode's result.
``enable_fp_fusion=False`` keeps the compiler from contracting products and sums differently in the two kernels.

The decode rows are bitwise the forward's rows at one tile height (:data:`BLOCK_M`), both kernels are faster than the
memory-efficient ones, and the SmolLM2 on-policy gate passes with ``model.packed_attention: chunked_varlen``
(``benchmarks/exact_split_decode.py``; BENCHMARKS.md, "Decode attention: fast and exact").

Which heads they take: :func:`rlrun.kernels.attention.chunked_kernel_takes` (importable without Triton).

Layouts: queries, keys, values and outputs are given by a base pointer per sample plus strides (sample, position,
head), so one forward serves the trainer's packed rows (``[T, heads, dim]``, samples bounded by ``cu_seqlens``) and the
engine's prefill over its cache (``[B, heads, L, dim]`` buffers, each row a sample from column 0).

Each launch runs under :func:`rlrun.kernels.triton_support.launch_device` of its tensors (Triton launches on the
current CUDA
device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device

CHUNK = 256
"""Keys a chunk: both sides split each row's keys at multiples of it; 256 is where the decode's and the forward's
fastest chunk sizes meet (BENCHMARKS.md, "Decode attention: fast and exact")."""
BLOCK_M = 64
"""Query rows a tile, on both sides: a forward tile's consecutive positions of one head, a decode tile's G query heads
of one cached head (padded). One height because the height picks the tensor-core instruction (Hopper's 64-row
warpgroup multiply at 64, the 16-row one at 16), and those round differently: a forward at 64 and a decode at 16 round
rare outputs apart, enough to put a real run off-policy. 64 because the forward gains more there than the decode loses,
which stays faster than the memory-efficient kernel (BENCHMARKS.md, "Decode attention: fast and exact"). Models with
more than 64 query heads a cached head (G) are not taken (:func:`rlrun.kernels.attention.chunked_kernel_takes`)."""
BLOCK_N = 64
"""Keys a step within a chunk, on both sides."""
MAX_SPLITS = 16
"""Programs a decode row and cached head at most (each takes every MAX_SPLITS-th chunk): a cache of many columns
launches no program per empty chunk (at 32K columns, 128 chunks a row)."""
WARPS = 4
STAGES = 2
"""Pipeline stages of the forward's key loop."""
DECODE_STAGES = 3
"""Pipeline stages of the decode's key loop. Stages schedule the loads, not the arithmetic, so every stage and warp
count keeps the decode rows bitwise the forward's; 3 is the fastest (``benchmarks/chunked_decode_launch.py``;
BENCHMARKS.md, "Decode attention: fast and exact", the launch settings)."""


@triton.jit
def _chunk_partial(q, k_base, v_base, stride_kn, stride_vn, start, stop, limit, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """One chunk's online softmax for a tile of query rows: keys [start, stop), row i seeing keys <= limit[i]
    (-1: a padding row, which stays at -inf / 0 / 0)."""
    offs_d = tl.arange(0, HEAD)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        inside = offs_n < stop
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(inside[None, :] & (offs_n[None, :] <= limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def _merge(big_m, big_l, big_acc, m, l, acc):  # noqa: E741
    """Chunk (m, l, acc) into the running (M, L, ACC), in chunk order on both sides."""
    m_new = tl.maximum(big_m, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(big_m - m_safe)
    b = tl.exp(m - m_safe)
    return m_new, big_l * a + l * b, big_acc * a[:, None] + acc * b[:, None]


@triton.jit
def _causal_attention(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_starts, k_starts, q_lens, firsts, scale,
                      stride_qs, stride_qt, stride_qh, stride_ks, stride_kt, stride_kh,
                      stride_vs, stride_vt, stride_vh, stride_os, stride_ot, stride_oh, stride_lh,
                      GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD: tl.constexpr, WITH_LSE: tl.constexpr):  # fmt: skip
    """Sample s's ``q_lens[s]`` queries (from ``q_starts[s]``, at positions ``firsts[s]`` on) over its keys (from
    ``k_starts[s]``), causally: a tile of BLOCK_M positions of one head walks its chunks in order. With WITH_LSE, each
    row's log-sum-exp of its scaled scores at ``lse_ptr[head, q_starts[s] + i]``."""
    block, head, sample = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n = tl.load(q_lens + sample)
    q_start = tl.load(q_starts + sample).to(tl.int64)
    k_start = tl.load(k_starts + sample).to(tl.int64)
    first = tl.load(firsts + sample)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    rows = offs_m < n
    q = tl.load(
        q_ptr + sample * stride_qs + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    limit = tl.where(rows, first + offs_m, -1)
    k_base = k_ptr + sample * stride_ks + k_start * stride_kt + (head // GROUPS) * stride_kh
    v_base = v_ptr + sample * stride_vs + k_start * stride_vt + (head // GROUPS) * stride_vh
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_M], tl.float32)
    big_acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    # the tile's last row sees keys 0 .. keys - 1; a tile past the sample's queries (the grid is the longest's) none
    keys = tl.where(block * BLOCK_M < n, first + tl.minimum(block * BLOCK_M + BLOCK_M, n), 0)
    for start in range(0, keys, CHUNK):
        m, l, acc = _chunk_partial(  # noqa: E741
            q, k_base, v_base, stride_kt, stride_vt, start, tl.minimum(start + CHUNK, keys), limit, scale,
            BLOCK_M, BLOCK_N, HEAD,
        )  # fmt: skip
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc)
    out = big_acc / big_l[:, None]
    tl.store(
        out_ptr + sample * stride_os + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows[:, None],
    )
    if WITH_LSE:
        tl.store(lse_ptr + head * stride_lh + q_start + offs_m, big_m + tl.log(big_l), mask=rows)


@triton.jit
def _decode_attention(q_ptr, k_ptr, v_ptr, counts_ptr, part_m, part_l, part_acc, arrivals, out_ptr, scale,
                      stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                      stride_ob, stride_oh, CHUNKS, GROUPS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """Chunks c, c + P, c + 2P, ... (P programs a row and cached head) of row b's keys for the G query heads of cached
    head j: each one's (m, l, acc) into the part buffers ([B, H_kv, CHUNKS, G(, HEAD)]: the tile's padding rows are
    not kept); chunks past the row's keys are neither computed nor read. The row and head's last program to arrive
    (ARRIVALS) merges the parts (:func:`_merge_parts`), so that a decode is one launch."""
    row, kv = tl.program_id(0).to(tl.int64), tl.program_id(1)
    count = tl.load(counts_ptr + row)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    heads = offs_m < GROUPS
    q = tl.load(
        q_ptr + row * stride_qb + (kv * GROUPS + offs_m)[:, None] * stride_qh + offs_d[None, :],
        mask=heads[:, None],
        other=0.0,
    )
    limit = tl.where(heads, count - 1, -1)
    k_base = k_ptr + row * stride_kb + kv * stride_kh
    v_base = v_ptr + row * stride_vb + kv * stride_vh
    pair = row * tl.num_programs(1) + kv  # this row and cached head: its counter, its CHUNKS parts
    first_part = pair * CHUNKS
    for chunk in range(tl.program_id(2), tl.cdiv(count, CHUNK), tl.num_programs(2)):
        start = chunk * CHUNK
        m, l, acc = _chunk_partial(  # noqa: E741
            q, k_base, v_base, stride_kn, stride_vn, start, tl.minimum(start + CHUNK, count), limit, scale,
            BLOCK_M, BLOCK_N, HEAD,
        )  # fmt: skip
        at = first_part + chunk
        tl.store(part_m + at * GROUPS + offs_m, m, mask=heads)
        tl.store(part_l + at * GROUPS + offs_m, l, mask=heads)
        tl.store(part_acc + (at * GROUPS + offs_m)[:, None] * HEAD + offs_d[None, :], acc, mask=heads[:, None])
    tl.debug_barrier()  # every thread's parts stored before the arrival releases them
    counter = arrivals + pair
    if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1:
        out = _merge_parts(part_m, part_l, part_acc, first_part, count, GROUPS, CHUNK, BLOCK_M, HEAD)
        tl.store(
            out_ptr + row * stride_ob + (kv * GROUPS + offs_m)[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=heads[:, None],
        )
        tl.store(counter, 0)  # ARRIVALS: zero again for the next decode


@triton.jit
def _merge_parts(part_m, part_l, part_acc, first_part, count,
                 GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """A row and cached head's chunks merged in order, as the forward merges them: its G heads' outputs (the tile's
    padding rows 0). The parts are read past the L1 cache (``.cg``), which other programs' stores do not reach."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    heads = offs_m < GROUPS
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_M], tl.float32)
    big_acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    for chunk in range(0, tl.cdiv(count, CHUNK)):
        at = first_part + chunk
        m = tl.load(part_m + at * GROUPS + offs_m, mask=heads, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_l + at * GROUPS + offs_m, mask=heads, other=0.0, cache_modifier=".cg")  # noqa: E741
        acc = tl.load(
            part_acc + (at * GROUPS + offs_m)[:, None] * HEAD + offs_d[None, :],
            mask=heads[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc)
    return big_acc / tl.where(heads, big_l, 1.0)[:, None]


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}
"""ARRIVALS: per device, int32 counters (one a decode row and cached head) of the programs that have stored their parts;
the last to arrive merges and sets its counter back to 0, so the buffer is all zeros between decodes and is never
cleared by a launch of its own. Buffers are only added, never freed: a captured step keeps the address it was captured
with. Decodes on one device must not overlap in time (the engine's steps run one after another on one stream)."""


def _arrivals(device: torch.device, size: int) -> torch.Tensor:
    """The device's newest counters if large enough, else new zeroed ones (ARRIVALS)."""
    kept = _ARRIVALS.setdefault(device, [])
    if not kept or kept[-1].numel() < size:
        kept.append(torch.zeros(max(size, 2 * kept[-1].numel() if kept else 0), dtype=torch.int32, device=device))
    return kept[-1]


def causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    max_queries: int,
    scale: float,
    logsumexp: torch.Tensor | None = None,
    block_m: int = BLOCK_M,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The forward into ``out``. ``query``/``out`` are ``[S, T, heads, dim]`` and ``key``/``value`` ``[S, T_k, kv_heads,
    dim]`` views (strides as they are: a stride-0 sample dimension for packed rows); ``layout`` =
    (query starts, key starts, query counts, first query positions), int32 ``[S]`` on the device; ``max_queries`` the
    largest query count (the grid). ``logsumexp``: ``[heads, T]`` fp32, filled where given."""
    samples, _, heads, dim = query.shape
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == out.stride(-1) == 1, "contiguous heads only"
    q_starts, k_starts, q_lens, firsts = layout
    lse = logsumexp if logsumexp is not None else out  # an unread pointer when WITH_LSE is off
    grid = (triton.cdiv(max_queries, block_m), heads, samples)
    with launch_device(query):
        _causal_attention[grid](
            query, key, value, out, lse, q_starts, k_starts, q_lens, firsts, scale,
            *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *out.stride()[:3],
            logsumexp.stride(0) if logsumexp is not None else 0,
            GROUPS=heads // key.shape[2], CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD=dim,
            WITH_LSE=logsumexp is not None, num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def causal_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
    with_logsumexp: bool = False,
    block_m: int = BLOCK_M,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention within each sample of a packed row (the trainer's layout): ``[T, heads, dim]`` queries over
    ``[T, kv_heads, dim]`` keys and values, samples bounded by ``cu_seqlens`` (int32, on the device). Returns the output
    and, with ``with_logsumexp``, the log-sum-exp in FlashAttention-2's varlen layout ``[heads, T]`` (its backward
    reads it)."""
    tokens, heads, _ = query.shape
    starts = cu_seqlens[:-1]
    layout = (starts, starts, cu_seqlens[1:] - starts, torch.zeros_like(starts))
    out = torch.empty_like(query)
    lse = torch.empty(heads, tokens, dtype=torch.float32, device=query.device) if with_logsumexp else None
    samples = starts.numel()
    views = (t[None].expand(samples, *t.shape) for t in (query, key, value, out))  # sample stride 0: one packed row
    causal(*views, layout, max_len, scale, lse, block_m, chunk)
    return out, lse


def decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    block_m: int = BLOCK_M,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One decode position's attention: queries ``[B, heads, dim]`` over cache views ``[B, kv_heads, L, dim]`` (any
    row and head strides, positions contiguous), row b reading its first ``counts[b]`` (int32) columns. Returns
    ``[B, heads, dim]``. The part buffers (fp32, B x heads x chunks x (dim + 2): 136 MB at 128 rows of 16 heads of 128
    and 32K columns) are allocated per call; a captured step's come from its graph's pool, reused layer after layer.
    One launch a call: the chunks' programs store their parts and the last to arrive merges them (ARRIVALS), which saves
    a layer's second launch (the merge kernel of the first version) in every decode step."""
    rows, heads, dim = query.shape
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "contiguous heads only"
    kv_heads, length = key.shape[1], key.shape[2]
    assert heads // kv_heads <= block_m, "a decode tile holds a cached head's G query heads"
    chunks = triton.cdiv(length, chunk)
    parts = rows * heads * chunks  # each chunk's (m, l, acc) per query head: [B, H_kv, chunks, G(, dim)]
    part_m, part_l = (torch.empty(parts, dtype=torch.float32, device=query.device) for _ in range(2))
    part_acc = torch.empty(parts * dim, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query)
    arrivals = _arrivals(query.device, rows * kv_heads)
    with launch_device(query):
        _decode_attention[(rows, kv_heads, min(chunks, MAX_SPLITS))](
            query, key, value, counts, part_m, part_l, part_acc, arrivals, out, scale, query.stride(0), query.stride(1),
            *key.stride()[:3], *value.stride()[:3], out.stride(0), out.stride(1), chunks,
            GROUPS=heads // kv_heads, CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD=dim, num_warps=WARPS,
            num_stages=DECODE_STAGES, enable_fp_fusion=False,
        )  # fmt: skip
    return out
