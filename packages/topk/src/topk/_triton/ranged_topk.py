"""Triton kernel for exact ranged top-k: sampled bracket, one streaming pass, exact resolve.

Every value is compared through an order-preserving int32 *key*: the float bits for x >= 0,
the magnitude bits flipped (and shifted by one, so that -0.0 and +0.0 share key 0) for x < 0.
Signed comparison of keys is comparison of the fp32 values; NaN and -inf map to ``_NONE``,
below every selectable key. The answer for a row is fixed by T, its k-th largest key, and r, how
many of the elements equal to T are taken (the first r in column order).

A program takes rows from a shared counter; per row (length ``L = hi - lo``):

1. **Bracket** (rows with L > k). ``SAMPLE`` columns spread over the range give a sample whose
   ranks around ``k * SAMPLE / L`` estimate T; two searches on the sample, in lockstep, return
   ``t_lo`` (about three standard deviations of rank below T) and ``t_hi`` (three above).
2. **Stream** the range once. Each warp owns a contiguous segment of it and appends every
   element >= ``t_lo`` (fp32 bits and column, in column order) to its own list in global
   scratch; ranks within a warp need no barrier. The lists are then concatenated (~k entries,
   L2 resident), so the stream is the only pass over the scores in HBM. Each step also hints
   L2 to fetch the tile ``PREFETCH`` steps ahead: the stream loads one tile a step before it
   is ranked, too few bytes in flight to cover HBM latency, and a prefetch holds no register.
3. **Retry** once if the list came out short of k or overflowed (an unlucky sample, about one
   row in 500): a new lower bound from the sample, calibrated by the count just measured, and
   one more streaming pass.
4. **Resolve** on the list when it proves the bracket right (it holds at least k elements, or
   every selectable one, and did not overflow): find T by interpolation search in
   ``[t_lo, t_hi]`` (or above t_hi) over the list held in registers, then write the chosen
   columns at the ranks given by cumsums (ascending column order; ties at T are taken in
   column order).
5. Otherwise (heavy ties at the bound, fewer than k selectable, two misses) a **slow exact
   path** re-reads the row: one pass counts the selectable elements and those above t_hi,
   which with ties usually pins T at once; else each bisection step is a counting pass.

HBM traffic is one read of the in-range scores plus the sample (~1/32 of it, in runs of whole
sectors on long rows); the lists and the output are small. The result depends only on the
scores, never on the schedule: the only atomic is the row counter.

Scratch: ``programs x warps x list_size`` int64 entries (about 70 MB at the H200 defaults for
k <= 2112, 140 MB at k = 4096), allocated per call (or once by a caller that launches for
block after block). The launch geometry and the host side of
the launch are in :mod:`topk._triton.launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Keys (see the module docstring). Thresholds handed to the streaming pass are compared as fp32,
# so they are kept away from zeros and subnormals (|key| < _KNORM), which a flush-to-zero compare
# would treat differently from the integer keys.
_NONE = tl.constexpr(-2147483648)  # NaN, -inf and columns outside the range
_KMIN = tl.constexpr(-2139095039)  # -FLT_MAX, the smallest selectable value
_KINF = tl.constexpr(2139095040)  # +inf, the largest selectable value
_KNORM = tl.constexpr(8388608)  # FLT_MIN, the smallest positive normal value


@triton.jit
def _order_key(bits):
    """The key of int32 fp32 bit patterns that are not NaN."""
    sign = bits >> 31
    return (bits ^ (sign & 0x7FFFFFFF)) - sign


@triton.jit
def _keys(bits, valid):
    """Keys of int32 fp32 bit patterns; NaN, -inf and ``valid == False`` lanes get ``_NONE``."""
    key = _order_key(bits)
    return tl.where(valid & (key >= _KMIN) & (key <= _KINF), key, _NONE)


@triton.jit
def _key_value(key):
    """The fp32 value of a selectable key (the inverse of :func:`_keys`)."""
    bits = tl.where(key >= 0, key, (key - 1) ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _midpoint(a, b):
    """floor((a + b) / 2) of two int32 keys, without int32 overflow."""
    a64 = a.to(tl.int64)
    return (a64 + ((b.to(tl.int64) - a64) >> 1)).to(tl.int32)


@triton.jit
def _chunk_keys(row_ptr, c0, lo, hi, CHUNK: tl.constexpr):
    """Keys of the ``CHUNK`` columns from ``c0``; only columns in [lo, hi) are read."""
    cols = c0 + tl.arange(0, CHUNK)
    inside = (cols >= lo) & (cols < hi)
    x = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return _keys(x.to(tl.int32, bitcast=True), inside)


@triton.jit
def _load_sample(row_ptr, lo, span, SAMPLE: tl.constexpr, RUN: tl.constexpr):
    """Keys of ``G = SAMPLE // RUN`` runs of ``RUN`` adjacent columns spread evenly over the
    range (runs keep the extra HBM sectors few on long rows), and how many are in range.

    A range that holds at least G whole runs aligned to ``RUN`` columns samples those: no mask,
    and each thread's part of a run is one vector load. (Scattered masked scalar loads are
    issued by ptxas one after another, each waiting on HBM: 16 per thread at 65536 columns.)
    Shorter ranges sample runs starting at ``floor(g * span / G)``, masked at the end.
    """
    G: tl.constexpr = SAMPLE // RUN
    first_run = tl.cdiv(lo, RUN)
    whole = (lo + span) // RUN - first_run
    if whole >= G:
        # Run g is whole run floor(g * whole / G), split so that no product overflows int32.
        run = tl.arange(0, G)[:, None]
        run = run * (whole // G) + (run * (whole % G)) // G
        cols = (first_run + run) * RUN + tl.arange(0, RUN)[None, :]
        bits = tl.load(row_ptr + cols).to(tl.float32).to(tl.int32, bitcast=True)
        keys = tl.reshape(_keys(bits, cols >= 0), [SAMPLE])
        n_in = tl.full([], SAMPLE, tl.int32)
    else:
        j = tl.arange(0, SAMPLE)
        # Run g starts at floor(g * span / G): split span so that no product overflows int32.
        g = j // RUN
        off = g * (span // G) + (g * (span % G)) // G + j % RUN
        inside = off < span
        x = tl.load(row_ptr + lo + off, mask=inside, other=0.0).to(tl.float32)
        keys = _keys(x.to(tl.int32, bitcast=True), inside)
        n_in = tl.sum(inside.to(tl.int32), 0)
    return keys, n_in


@triton.jit
def _search_sample(keys, n_sel, j_hi, j_lo, eps):
    """Keys near the sample elements of ranks j_hi and j_lo (1 = largest): returns ``b_hi``,
    with count(keys >= b_hi) < j_hi, and ``a_lo``, with count(keys >= a_lo) >= j_lo, each
    within ``eps`` sample elements of the rank (ranks are clamped to [1, n_sel]).

    Two searches in lockstep (lane 0, lane 1), with the invariant count(>= a) = ca >=
    target > cb = count(>= b), from [min, max] of the sample. The pivot halves the interval in
    key space (about log-scale in value), except while the interval holds zero, where key
    space would spend steps on tiny magnitudes: there it halves the value range instead.
    """
    lane = tl.arange(0, 2)
    target = tl.minimum(tl.maximum(tl.where(lane == 0, j_hi, j_lo), 1), tl.maximum(n_sel, 1))
    a = tl.full([2], 0, tl.int32) + tl.min(tl.where(keys != _NONE, keys, _KINF), 0)
    b = tl.full([2], 1, tl.int32) + tl.max(keys, 0)
    ca = tl.full([2], 0, tl.int32) + n_sel
    cb = tl.full([2], 0, tl.int32)
    active = ca - cb > eps
    while tl.max(active.to(tl.int32), 0) > 0:
        half = 0.5 * _key_value(a) + 0.5 * _key_value(b - 1)
        by_value = _order_key(half.to(tl.int32, bitcast=True))
        use_value = (a <= 0) & (b > 0) & (by_value > a) & (by_value < b)
        m = tl.where(use_value, by_value, _midpoint(a, b))
        c = tl.sum((keys[None, :] >= m[:, None]).to(tl.int32), 1)
        up = active & (c >= target)
        down = active & (c < target)
        a = tl.where(up, m, a)
        ca = tl.where(up, c, ca)
        b = tl.where(down, m, b)
        cb = tl.where(down, c, cb)
        active = (ca - cb > eps) & (b > a + 1)
    return tl.sum(tl.where(lane == 0, b, 0), 0), tl.sum(tl.where(lane == 1, a, 0), 0)


@triton.jit
def _normal_lower(t):
    """A lower bound among zeros and subnormals, widened to the nearest normal value (the
    stream compares fp32 values, which a flush-to-zero compare would get wrong there)."""
    return tl.where((t > -_KNORM) & (t < _KNORM), -_KNORM, t)


@triton.jit
def _sample_bracket(row_ptr, lo, span, k, SAMPLE: tl.constexpr, RUN: tl.constexpr):
    """Keys ``(t_lo, t_hi)`` that very likely bracket the k-th largest of the row.

    A sample element of rank j stands for rank about ``j * span / n_in`` of the row; ``t_lo``
    is the sample element of rank ``jc + 3 sd + 2`` and ``t_hi`` the one of rank
    ``jc - 3 sd - 2``, with ``jc`` the expected rank of the k-th largest and ``sd`` its
    binomial standard deviation, each within ``sd / 2`` sample elements (a looser bound, never
    a wrong one). A rank beyond the sample gives the open bound (``_KMIN`` / ``_KINF``).
    """
    keys, n_in = _load_sample(row_ptr, lo, span, SAMPLE, RUN)
    n_sel = tl.sum((keys != _NONE).to(tl.int32), 0)
    jc = k.to(tl.float32) * n_in.to(tl.float32) / span.to(tl.float32)
    sd = tl.sqrt(tl.maximum(jc * (1.0 - jc / n_in.to(tl.float32)), 0.0))
    j_hi = tl.floor(jc - 3.0 * sd - 2.0).to(tl.int32)
    j_lo = tl.ceil(jc + 3.0 * sd + 2.0).to(tl.int32)
    eps = tl.maximum((0.5 * sd).to(tl.int32), 1)
    b_hi, a_lo = _search_sample(keys, n_sel, j_hi, j_lo, eps)
    t_hi = tl.where((j_hi < 1) | (j_hi > n_sel), _KINF, b_hi - 1)
    t_lo = tl.where(j_lo > n_sel, _KMIN, a_lo)
    # t_hi is compared as a key only, but kept normal too so that the bounds stay ordered.
    t_hi = tl.where((t_hi > -_KNORM) & (t_hi < _KNORM), _KNORM, t_hi)
    return _normal_lower(t_lo), t_hi


@triton.jit
def _retry_bound(row_ptr, lo, span, t_lo, n_cand, target, SAMPLE: tl.constexpr, RUN: tl.constexpr):
    """A new lower bound expected to have ``target`` elements above it, after ``t_lo`` turned
    out to have ``n_cand``: the sample element of rank ``ca * target / n_cand``, where ca
    sample elements are >= t_lo. Calibrating the sample by the measured count corrects what
    made the first bound miss (a plain unlucky sample, or sampled columns unlike the rest)."""
    keys, _in_range = _load_sample(row_ptr, lo, span, SAMPLE, RUN)
    n_sel = tl.sum((keys != _NONE).to(tl.int32), 0)
    ca = tl.sum((keys >= t_lo).to(tl.int32), 0)
    scale = target.to(tl.float32) / tl.maximum(n_cand, 1).to(tl.float32)
    rank = tl.ceil(ca.to(tl.float32) * scale).to(tl.int32)
    _b_hi, a_lo = _search_sample(keys, n_sel, rank, rank, 1)
    return _normal_lower(tl.where(rank > n_sel, _KMIN, a_lo))


@triton.jit
def _load_tile(row_ptr, cols, lo, hi):
    """The ``[32, WARPS, REPS, 4]`` tile of scores at ``cols`` (-inf outside [lo, hi))."""
    return tl.load(row_ptr + cols, mask=(cols >= lo) & (cols < hi), other=float("-inf"))


@triton.jit
def _stream_tile(x, cols, v_lo, region, n_w, LIST: tl.constexpr, REPS: tl.constexpr):
    """One step of :func:`_stream_lists`: append the tile's elements >= v_lo to the lists;
    returns the list sizes ``n_w`` (``[WARPS]``) updated.

    A candidate's rank in its segment's list counts the candidates in earlier rows of the step,
    in earlier lanes of its own row and in earlier vector slots of its own thread. The lane
    prefix is one warp scan of each thread's counts with the rows packed in bytes (a row holds
    at most 128 per warp; ``REPS <= 4`` rows fill an int32). The scan runs on the counts
    transposed to ``[WARPS, 32]``: Triton 3.6 lowers scans only in a blocked layout (a scan of
    a reduced 4-D tile trips an assertion), and that shape's default one places the counts
    where their slice layout already holds them, so no data moves.
    """
    tl.static_assert(REPS <= 4, "row counts are packed in the 4 bytes of an int32")
    rep = tl.arange(0, REPS)[None, None, :, None]
    x = x.to(tl.float32)
    cand = x >= v_lo
    c = cand.to(tl.int32)
    packed = tl.sum(tl.sum(c << (8 * rep), 3), 2)  # [32, WARPS]
    lanes = tl.trans(tl.cumsum(tl.trans(packed), 1))[:, :, None, None]
    rows = tl.sum(packed, 0)  # [WARPS]: byte q counts the candidates of row q
    before = tl.zeros_like(c) + n_w[None, :, None, None]
    total = n_w
    for q in tl.static_range(REPS):
        in_row = (rows >> (8 * q)) & 0xFF
        before += tl.where(rep > q, in_row[None, :, None, None], 0)
        total += in_row
    # The lane prefix is inclusive of this thread's row: take its row count back out.
    mine = tl.sum(c, 3, keep_dims=True)
    pos = before + ((lanes >> (8 * rep)) & 0xFF) - mine + tl.cumsum(c, 3) - 1
    entry = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | cols.to(tl.uint32).to(tl.int64)
    tl.store(region + pos, entry, mask=cand & (pos < LIST))
    return total


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (``prefetch.global.L2``: a hint; no register waits)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _stream_lists(
    row_ptr,
    lo,
    hi,
    v_lo,
    list_ptr,
    LIST: tl.constexpr,
    REPS: tl.constexpr,
    WARPS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Append every element >= ``v_lo`` of the row range to per-warp lists; return their
    sizes (``[WARPS]``).

    Segment w, a contiguous part of the range (a multiple of ``REPS * 128`` columns), fills
    the w-th ``LIST``-entry region of the scratch in column order. Tiles are
    ``[32, WARPS, REPS, 4]`` (lane, segment, row of 128 columns, vector): the order of dims for
    which Triton gives the loads (16 bytes, 4 adjacent columns per thread) and the scattered
    list stores the same layout, with one warp per segment, so that the ranks need only
    in-thread and warp scans and the pass has no barrier or shared-memory shuffle.

    Steps whose tile lies inside [lo, hi) for every segment load without a mask (vectorized)
    and one step ahead; the few others (the first, the last) are separate loops so that the
    two kinds of load do not share registers. Interior steps also prefetch the tile
    ``PREFETCH`` steps ahead into L2 (one hint per thread and 128-column row, clamped to the
    range, so no line outside it is fetched). Values are compared as fp32: ``v_lo`` is normal
    or infinite, so this is the key order even under flush-to-zero compares; NaN and masked
    lanes (loaded as -inf) compare false. An entry is the fp32 bit pattern (high word) and the
    column (low word). Entries past ``LIST`` are dropped but still counted.
    """
    lane = tl.arange(0, 32)[:, None, None, None]
    wid = tl.arange(0, WARPS)[None, :, None, None]
    rep = tl.arange(0, REPS)[None, None, :, None]
    vec = tl.arange(0, 4)[None, None, None, :]
    width = REPS * 128
    a0 = (lo // 128) * 128  # aligned start, so that interior tiles vectorize
    seg = tl.cdiv(tl.cdiv(hi - a0, WARPS), width) * width
    offs = a0 + wid * seg + rep * 128 + lane * 4 + vec
    ahead = a0 + wid * seg + rep * 128 + lane * 4 + PREFETCH * width  # [32, WARPS, REPS, 1]
    region = list_ptr + wid * LIST
    # Step `it` is interior iff a0 + it >= lo (segment 0) and it <= lim (the last segment).
    lim = hi - (a0 + (WARPS - 1) * seg + width)
    first = tl.minimum(tl.where(a0 >= lo, 0, width), seg)
    stop = tl.where(lim >= 0, tl.minimum((lim // width + 1) * width, seg), 0)
    stop = tl.maximum(stop, first)
    n_w = tl.zeros([WARPS], tl.int32)
    for it in range(0, first, width):
        tile = _load_tile(row_ptr, offs + it, lo, hi)
        n_w = _stream_tile(tile, offs + it, v_lo, region, n_w, LIST, REPS)
    if stop > first:
        # Interior steps, two per iteration with the tiles in alternate buffers, each loaded
        # one step before it is ranked: a buffer is reloaded only after its last use, so no
        # register copy (which would wait on the load) moves a tile between iterations.
        xa = tl.load(row_ptr + offs + first)
        pairs_end = first + ((stop - first - width) // (2 * width)) * (2 * width)
        for it in range(first, pairs_end, 2 * width):
            if PREFETCH > 0:
                _prefetch_l2(row_ptr + tl.minimum(ahead + it, hi - 1))
            xb = tl.load(row_ptr + offs + (it + width))
            n_w = _stream_tile(xa, offs + it, v_lo, region, n_w, LIST, REPS)
            if PREFETCH > 0:
                _prefetch_l2(row_ptr + tl.minimum(ahead + (it + width), hi - 1))
            xa = tl.load(row_ptr + offs + (it + 2 * width))
            n_w = _stream_tile(xb, offs + (it + width), v_lo, region, n_w, LIST, REPS)
        if stop - pairs_end > width:
            xb = tl.load(row_ptr + offs + (pairs_end + width))
            n_w = _stream_tile(xa, offs + pairs_end, v_lo, region, n_w, LIST, REPS)
            n_w = _stream_tile(xb, offs + (pairs_end + width), v_lo, region, n_w, LIST, REPS)
        else:
            n_w = _stream_tile(xa, offs + pairs_end, v_lo, region, n_w, LIST, REPS)
    for it in range(stop, seg, width):
        tile = _load_tile(row_ptr, offs + it, lo, hi)
        n_w = _stream_tile(tile, offs + it, v_lo, region, n_w, LIST, REPS)
    return n_w


@triton.jit
def _compact_lists(list_ptr, n_w, LIST: tl.constexpr, WARPS: tl.constexpr):
    """Move the per-warp lists behind warp 0's, giving one list in column order at list_ptr.

    Warp w's entries go to offset ``sum(n_w[:w])`` of region 0; the regions of warps >= 1 are
    only read, region 0 past its own entries only written, so nothing overlaps. The offsets
    are a masked sum rather than a cumsum over the ``WARPS`` counts (a scan of a tile smaller
    than the program, which Triton 3.6 cannot lower). Each step moves up to 1024 entries per
    warp: the moves wait on L2 reads, so few wide steps beat many narrow ones (~750 entries
    per warp at 65536 columns and k = 2048: 1 step instead of 12 of 64).
    """
    wid = tl.arange(0, WARPS)
    earlier = wid[None, :] < wid[:, None]
    start = tl.sum(tl.where(earlier, n_w[None, :], 0), 1)[:, None]
    for j0 in range(0, tl.max(n_w), 1024):
        j = j0 + tl.arange(0, 1024)[None, :]
        move = (wid[:, None] > 0) & (j < n_w[:, None])
        entry = tl.load(list_ptr + wid[:, None] * LIST + j, mask=move, other=0)
        tl.store(list_ptr + start + j, entry, mask=move)


@triton.jit
def _select_rule(a, ca, cb, k_eff, k, t_below):
    """``(T, r)`` once a search stopped, from its invariant count(>= a) = ca >= k_eff > cb.

    * ``ca == k_eff``: everything >= a is taken (T = a, r = k covers all ties at a);
    * ``k_eff - cb == 1``: one more element is needed, the largest below b: T = ``t_below``;
    * otherwise b == a + 1, so T = a and its first ``k_eff - cb`` occurrences are taken.
    """
    t = tl.where((ca != k_eff) & (k_eff - cb == 1), t_below, a)
    r = tl.where(ca == k_eff, k, k_eff - cb)
    return t, r


@triton.jit
def _emit(keys, cols, t, r, base_gt, base_eq, out_row):
    """Write the columns of keys > t and of the first r keys == t (in order) to their ranks.

    ``base_gt`` / ``base_eq`` count the elements > t / == t in earlier blocks of the same row;
    returns them updated. One cumsum ranks both kinds: elements > t count in the low 16 bits,
    == t in the high 16 bits, so blocks are at most 32768 wide.
    """
    gt = keys > t
    eq = keys == t
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    incl = tl.cumsum(packed, 0)
    n_eq = base_eq + (incl >> 16)
    take = gt | (eq & (n_eq <= r))
    pos = base_gt + (incl & 0xFFFF) + tl.minimum(n_eq, r) - 1
    tl.store(out_row + pos, cols, mask=take)
    total = tl.sum(packed, 0)
    return base_gt + (total & 0xFFFF), base_eq + (total >> 16)


@triton.jit
def _list_keys(list_ptr, j, n_cand):
    """Keys and columns of the list entries at ``j`` (``_NONE`` past the ``n_cand`` entries)."""
    valid = j < n_cand
    entry = tl.load(list_ptr + j, mask=valid, other=0)
    return _keys((entry >> 32).to(tl.int32), valid), (entry & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _list_threshold(keys, n_cand, t_lo, t_hi, k_eff, k):
    """``(T, r)`` of the k_eff largest of ``keys`` (a 1-D tile holding every element >= t_lo,
    ``n_cand`` of them, ``_NONE`` elsewhere); ``t_hi`` (``_KINF`` if unknown) only shortens the
    search. Also used by the indexer's fused logits -> top-k kernel on its candidate lists."""
    above = tl.sum((keys > t_hi).to(tl.int32))
    hi_ok = above < k_eff  # else T > t_hi: search (t_hi, +inf] instead
    a = tl.where(hi_ok, t_lo, t_hi + 1)
    ca = tl.where(hi_ok, n_cand, above)
    b = tl.where(hi_ok, t_hi + 1, _KINF + 1)
    cb = tl.where(hi_ok, above, 0)
    # Interpolation search: the pivot is the value at which a count(>= x) linear in x between
    # (value(a), ca) and (value(b - 1), cb) crosses k_eff - 1/2; counts are smooth in x for
    # continuous data, so this usually ends in about 5 steps instead of about 10. A step that
    # does not halve the distance to the target (in elements) is followed by a bisection step
    # (as is any step with an infinite end), which keeps the worst case logarithmic.
    excess = tl.minimum(ca - k_eff, k_eff - 1 - cb)
    bisect = excess < 0  # False, as a scalar tensor
    while (ca > k_eff) & (k_eff - cb > 1) & (b > a + 1):
        frac = ((ca - k_eff).to(tl.float32) + 0.5) / (ca - cb).to(tl.float32)
        va = _key_value(a)
        guess = (va + (_key_value(b - 1) - va) * frac).to(tl.int32, bitcast=True)
        guess = tl.minimum(tl.maximum(_order_key(guess), a + 1), b - 1)
        m = tl.where(bisect | (b > _KINF), _midpoint(a, b), guess)
        c = tl.sum((keys >= m).to(tl.int32))
        up = c >= k_eff
        a = tl.where(up, m, a)
        ca = tl.where(up, c, ca)
        b = tl.where(up, b, m)
        cb = tl.where(up, cb, c)
        left = tl.minimum(ca - k_eff, k_eff - 1 - cb)
        bisect = (~bisect) & (2 * left > excess)
        excess = left
    t_below = a
    if (ca != k_eff) & (k_eff - cb == 1):
        t_below = tl.max(tl.where(keys < b, keys, _NONE))
    return _select_rule(a, ca, cb, k_eff, k, t_below)


@triton.jit
def _resolve_list(
    list_ptr, n_cand, t_lo, t_hi, k_eff, k, out_row, LIST: tl.constexpr, EMIT: tl.constexpr
):
    """Exact T and r from the list (every element >= t_lo, in column order); write the row.

    The list holds every element >= t_lo, so T is found from it alone whatever t_hi turns
    out to be; t_hi only shortens the search. The search holds the list's keys in registers
    (one 1-D tile); the output is then written from the list again in blocks of ``EMIT``
    (L1 / L2 hits), so that the ranks and the scattered store never need the whole list live.
    """
    keys, _cols = _list_keys(list_ptr, tl.arange(0, LIST), n_cand)
    t, r = _list_threshold(keys, n_cand, t_lo, t_hi, k_eff, k)
    base_gt = tl.full([], 0, tl.int32)
    base_eq = tl.full([], 0, tl.int32)
    for j0 in range(0, n_cand, EMIT):
        block, cols = _list_keys(list_ptr, j0 + tl.arange(0, EMIT), n_cand)
        base_gt, base_eq = _emit(block, cols, t, r, base_gt, base_eq, out_row)


@triton.jit
def _stream_count(row_ptr, lo, hi, thr, CHUNK: tl.constexpr):
    """Number of keys >= ``thr`` in the row range (one pass over the row)."""
    n = tl.full([], 0, tl.int32)
    for c0 in range((lo // CHUNK) * CHUNK, hi, CHUNK):
        keys = _chunk_keys(row_ptr, c0, lo, hi, CHUNK)
        n += tl.sum((keys >= thr).to(tl.int32), 0)
    return n


@triton.jit
def _resolve_stream(row_ptr, lo, hi, n_cand, t_lo, t_hi, k, out_row, CHUNK: tl.constexpr):
    """Slow exact path: T, r and the output from passes over the row. Returns k_eff.

    Starts from what the streaming pass proved, count(>= t_lo) = n_cand (exact even when the
    list overflowed), and one more pass counts the selectable elements and those above t_hi.
    With heavy ties at the bracket (the usual reason to be here) that pins T at once; each
    further bisection step is one counting pass over the row.
    """
    n_sel = tl.full([], 0, tl.int32)
    n_above = tl.full([], 0, tl.int32)
    for c0 in range((lo // CHUNK) * CHUNK, hi, CHUNK):
        keys = _chunk_keys(row_ptr, c0, lo, hi, CHUNK)
        n_sel += tl.sum((keys != _NONE).to(tl.int32), 0)
        n_above += tl.sum((keys > t_hi).to(tl.int32), 0)
    k_eff = tl.minimum(n_sel, k)
    if k_eff > 0:
        # count(>= a) = ca >= k_eff > cb = count(>= b), from the tightest known bounds.
        lo_ok = n_cand >= k_eff
        hi_ok = n_above < k_eff
        a = tl.where(hi_ok, tl.where(lo_ok, t_lo, _KMIN), t_hi + 1)
        ca = tl.where(hi_ok, tl.where(lo_ok, n_cand, n_sel), n_above)
        b = tl.where(lo_ok, tl.where(hi_ok, t_hi + 1, _KINF + 1), t_lo)
        cb = tl.where(lo_ok, tl.where(hi_ok, n_above, 0), n_cand)
        while (ca > k_eff) & (k_eff - cb > 1) & (b > a + 1):
            m = _midpoint(a, b)
            c = _stream_count(row_ptr, lo, hi, m, CHUNK)
            up = c >= k_eff
            a = tl.where(up, m, a)
            ca = tl.where(up, c, ca)
            b = tl.where(up, b, m)
            cb = tl.where(up, cb, c)
        t_below = a
        if (ca != k_eff) & (k_eff - cb == 1):
            t_below = tl.full([], _NONE, tl.int32)
            for c0 in range((lo // CHUNK) * CHUNK, hi, CHUNK):
                keys = _chunk_keys(row_ptr, c0, lo, hi, CHUNK)
                t_below = tl.maximum(t_below, tl.max(tl.where(keys < b, keys, _NONE), 0))
        t, r = _select_rule(a, ca, cb, k_eff, k, t_below)
        base_gt = tl.full([], 0, tl.int32)
        base_eq = tl.full([], 0, tl.int32)
        for c0 in range((lo // CHUNK) * CHUNK, hi, CHUNK):
            keys = _chunk_keys(row_ptr, c0, lo, hi, CHUNK)
            cols = c0 + tl.arange(0, CHUNK)
            base_gt, base_eq = _emit(keys, cols, t, r, base_gt, base_eq, out_row)
    return k_eff


@triton.jit(noinline=True)
def _topk_row(
    scores_ptr,
    stride_row,
    lo_ptr,
    hi_ptr,
    out_ptr,
    list_ptr,
    row,
    k,
    CHUNK: tl.constexpr,
    SAMPLE: tl.constexpr,
    RUN: tl.constexpr,
    LIST: tl.constexpr,
    REPS: tl.constexpr,
    TAIL: tl.constexpr,
    WARPS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """All of one row. A separate function so that per-thread index patterns are rebuilt per
    row instead of being hoisted out of the row loop, where they would pin registers."""
    lo = tl.load(lo_ptr + row)
    hi = tl.maximum(tl.load(hi_ptr + row), lo)
    span = hi - lo
    row_ptr = scores_ptr + row.to(tl.int64) * stride_row
    out_row = out_ptr + row.to(tl.int64) * k

    t_lo = tl.full([], _KMIN, tl.int32)
    t_hi = tl.full([], _KINF, tl.int32)
    if span > k:
        t_lo, t_hi = _sample_bracket(row_ptr, lo, span, k, SAMPLE, RUN)
    # Stream the row into the lists. They are usable if they hold every selectable element (no
    # lower bound) or at least k of them, and did not overflow. An unlucky sample (about 1 row
    # in 500 at 3 standard deviations) is corrected by one more pass with a bound aimed a
    # quarter of the way from k to LIST rather than by the slow path (aimed at the middle, the
    # rank estimate from a short list overshot the list at k = 640: one such row in 4096 sent
    # to the slow path doubled the kernel's time); heavy ties at the bound leave nothing to
    # move and go to the slow path. (Two call sites rather than a loop around one: LLVM
    # hoists the stream's per-thread index patterns out of such a loop, where they pin
    # registers through the whole row.)
    n_w = _stream_lists(row_ptr, lo, hi, _key_value(t_lo), list_ptr, LIST, REPS, WARPS, PREFETCH)
    n_cand = tl.sum(n_w, 0)
    fits = (n_cand <= LIST) & ((t_lo == _KMIN) | (n_cand >= k))
    if (~fits) & (span > k) & (k < LIST):
        # (The CTA-wide reductions in _retry_bound order the first pass's list stores before
        # the second's.)
        t_new = _retry_bound(row_ptr, lo, span, t_lo, n_cand, (3 * k + LIST) // 4, SAMPLE, RUN)
        if t_new != t_lo:
            n_w = _stream_lists(
                row_ptr, lo, hi, _key_value(t_new), list_ptr, LIST, REPS, WARPS, PREFETCH
            )
            n_cand = tl.sum(n_w, 0)
            t_lo = t_new
            t_hi = tl.where(t_hi >= t_lo, t_hi, _KINF)
            fits = (n_cand <= LIST) & ((t_lo == _KMIN) | (n_cand >= k))
    tl.debug_barrier()  # the lists are read by other warps from here on

    # With no lower bound the list holds every selectable element, so it also counts them.
    complete = t_lo == _KMIN
    k_eff = tl.where(complete, tl.minimum(n_cand, k), k)
    if fits:
        _compact_lists(list_ptr, n_w, LIST, WARPS)
        tl.debug_barrier()
        _resolve_list(list_ptr, n_cand, t_lo, t_hi, k_eff, k, out_row, LIST, 256 * WARPS)
    else:
        k_eff = _resolve_stream(row_ptr, lo, hi, n_cand, t_lo, t_hi, k, out_row, CHUNK)

    for j0 in range((k_eff // TAIL) * TAIL, k, TAIL):
        j = j0 + tl.arange(0, TAIL)
        tl.store(out_row + j, tl.full([TAIL], -1, tl.int32), mask=(j >= k_eff) & (j < k))
    tl.debug_barrier()  # everyone is done with the list before the next row refills it


@triton.jit(do_not_specialize=["k"])
def _ranged_topk_kernel(
    scores_ptr,
    stride_row,
    lo_ptr,
    hi_ptr,
    out_ptr,
    list_base,
    counter_ptr,
    rows,
    k,
    CHUNK: tl.constexpr,
    SAMPLE: tl.constexpr,
    RUN: tl.constexpr,
    LIST: tl.constexpr,
    REPS: tl.constexpr,
    TAIL: tl.constexpr,
    WARPS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # Rows come from a counter rather than a fixed stride so that the grid may exceed what is
    # resident at once and uneven rows (causal ranges) still balance.
    list_ptr = list_base + tl.program_id(0).to(tl.int64) * (WARPS * LIST)
    row = tl.atomic_add(counter_ptr, 1)
    while row < rows:
        _topk_row(
            scores_ptr,
            stride_row,
            lo_ptr,
            hi_ptr,
            out_ptr,
            list_ptr,
            row,
            k,
            CHUNK,
            SAMPLE,
            RUN,
            LIST,
            REPS,
            TAIL,
            WARPS,
            PREFETCH,
        )
        row = tl.atomic_add(counter_ptr, 1)
