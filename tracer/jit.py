"""The recorder's compiled CPU kernels as LLVM IR, and the C signature of each function (see
tracer/kernels.py, which loads them through tracer/codecache.py on first use and holds the only
references to what that returns).

Why IR and not numba: numba's typing machinery costs a process its import and its CPU target
every time, cached kernels or not; llvmlite alone parses, optimises and compiles these few
functions, and a later process loads the cached code without compiling anything. The functions
take raw addresses and element counts (C ABI), are called through ctypes (which lets the GIL go
for the call), and are checked against known answers before any is used (`kernels._checked`).
"""

from __future__ import annotations

import ctypes
from typing import Any


def _block_squares(values: str, then: str) -> str:
    """The blocks' inner loop of the blocked norm kernels: the float64 sum of squares %acc1 of the
    float32 values at `values` from %b0 to %bend, continuing %acc_b; then on to block `then`."""
    return f"""squares:
  %j = phi i64 [%b0, %block], [%j1, %squares]
  %acc = phi double [%acc_b, %block], [%acc1, %squares]
  %xp = getelementptr float, ptr {values}, i64 %j
  %x = load float, ptr %xp
  %xd = fpext float %x to double
  %sq = fmul reassoc contract double %xd, %xd
  %acc1 = fadd reassoc contract double %acc, %sq
  %j1 = add nuw nsw i64 %j, 1
  %c = icmp slt i64 %j1, %bend
  br i1 %c, label %squares, label {then}
"""


def _add_to(array: str, at: str, value: str, name: str) -> str:
    """The float32 `value` added into element `at` of the float32 `array` (its IR values named
    `name`, `name`p and `name`n)."""
    return (f"  {name}p = getelementptr float, ptr {array}, i64 {at}\n  {name} = load float, ptr {name}p\n"
            f"  {name}n = fadd float {name}, {value}\n  store float {name}n, ptr {name}p\n")


def _block_bounds(end: str) -> str:
    """The blocked kernels' block head: %bend, the end of the block of 2048 values (L1-sized)
    that starts at %b0, no further than `end`; then on to %squares (`_block_squares`)."""
    return f"""  %bend0 = add i64 %b0, 2048
  %short = icmp slt i64 {end}, %bend0
  %bend = select i1 %short, i64 {end}, i64 %bend0
  br label %squares
"""


def _span(array: str, at: str) -> str:
    """A block's body: %s0 and %s1, entries `at` and `at` + 1 (the IR value `at`1) of the int64
    `array`, the ends of a range of segments; then on to %seg."""
    return (f"  %s0p = getelementptr i64, ptr {array}, i64 {at}\n  %s0 = load i64, ptr %s0p\n"
            f"  {at}1 = add nuw nsw i64 {at}, 1\n  %s1p = getelementptr i64, ptr {array}, i64 {at}1\n"
            "  %s1 = load i64, ptr %s1p\n  br label %seg\n")


def _add_into_sums(rows: tuple[tuple[int, str], ...]) -> str:
    """forward_sums: each float32 value of `rows` ((row of sums, IR value) pairs) added, as
    float64, into that row's column %s of the row-major sums (rows %S apart)."""
    out = []
    for k, value in rows:
        at = "%s"
        if k:
            at = f"%i{k}x"
            out.append(f"  {at} = add i64 %S{k if k > 1 else ''}, %s")
        out += [f"  %a{k}p = getelementptr double, ptr %sums, i64 {at}", f"  %a{k} = load double, ptr %a{k}p",
                f"  %e{k} = fpext float {value} to double", f"  %a{k}n = fadd double %a{k}, %e{k}",
                f"  store double %a{k}n, ptr %a{k}p"]
    return "\n".join(out) + "\n"


# Both norm kernels: for each float32 tensor at addrs[i] holding lens[i] values, a loop (`{loop}`,
# blocks that start at %first and leave for %tail from %last with the float64 sum of squares in
# %acc_end) whose square root goes into out[i] as float32; they return 1 if every norm is finite
_NORMS = r"""
define i32 @{name}(ptr noalias nocapture readonly %addrs, ptr noalias nocapture readonly %lens, ptr noalias nocapture %out{params}, i64 %count) nounwind {{
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %tail]
  %ok = phi i32 [1, %entry], [%ok1, %tail]
  %more = icmp slt i64 %i, %count
  br i1 %more, label %body, label %exit
body:
  %ap = getelementptr i64, ptr %addrs, i64 %i
  %addr = load i64, ptr %ap
  %lp = getelementptr i64, ptr %lens, i64 %i
  %n = load i64, ptr %lp
  %p = inttoptr i64 %addr to ptr
  %has = icmp sgt i64 %n, 0
  br i1 %has, label %first, label %tail
{loop}
tail:
  %s = phi double [0.0, %body], [%acc_end, %last]
{tail}
  %r = call double @llvm.sqrt.f64(double %s)
  %v = fptrunc double %r to float
  %op = getelementptr float, ptr %out, i64 %i
  store float %v, ptr %op
  %d = fsub float %v, %v
  %fin = fcmp oeq float %d, 0.0
  %fin32 = zext i1 %fin to i32
  %ok1 = and i32 %ok, %fin32
  %i1 = add nuw nsw i64 %i, 1
  br label %head
exit:
  ret i32 %ok
}}
"""

# the norm kernels' loops over one tensor's %n values at %p (entered at %first from %body, left
# for %tail from %last with the float64 sum of squares in %acc_end): the plain one, its sum of
# squares reassociated so that it vectorises; and the one that also sums the 32-bit words (mod
# 2^32, into %sum_w), each block of 2048 values summed as squares, then as words, while in L1
_SQUARES_LOOP = r"""first:
  br label %last
last:
  %j = phi i64 [0, %first], [%j1, %last]
  %acc = phi double [0.0, %first], [%acc_end, %last]
  %xp = getelementptr float, ptr %p, i64 %j
  %x = load float, ptr %xp
  %xd = fpext float %x to double
  %sq = fmul reassoc contract double %xd, %xd
  %acc_end = fadd reassoc contract double %acc, %sq
  %j1 = add nuw nsw i64 %j, 1
  %c = icmp slt i64 %j1, %n
  br i1 %c, label %last, label %tail"""
_WORDS_LOOP = r"""first:
  br label %block
block:
  %b0 = phi i64 [0, %first], [%b1, %last]
  %acc_b = phi double [0.0, %first], [%acc_end, %last]
  %sum_b = phi i32 [0, %first], [%sum_w, %last]
""" + _block_bounds("%n") + _block_squares("%p", "%words") + r"""words:
  %k = phi i64 [%b0, %squares], [%k1, %words]
  %sum = phi i32 [%sum_b, %squares], [%sum1, %words]
  %wp = getelementptr i32, ptr %p, i64 %k
  %w = load i32, ptr %wp
  %sum1 = add i32 %sum, %w
  %k1 = add nuw nsw i64 %k, 1
  %ck = icmp slt i64 %k1, %bend
  br i1 %ck, label %words, label %last
last:
  %acc_end = phi double [%acc1, %words]
  %sum_w = phi i32 [%sum1, %words]
  %b1 = phi i64 [%bend, %words]
  %cb = icmp slt i64 %b1, %n
  br i1 %cb, label %block, label %tail"""
# the words' sum, stored into sums[i] as an int64
_WORDS_TAIL = r"""  %ws = phi i32 [0, %body], [%sum_w, %last]
  %ws64 = zext i32 %ws to i64
  %sp = getelementptr i64, ptr %sums, i64 %i
  store i64 %ws64, ptr %sp"""

_TENSOR_NORMS = _NORMS.format(name="tensor_norms", params="", tail="", loop=_SQUARES_LOOP)
_NORMS_WORD_SUMS = _NORMS.format(name="norms_word_sums", params=", ptr noalias nocapture %sums",
                                 loop=_WORDS_LOOP, tail=_WORDS_TAIL)

# one segment's float64 sum of squares (and, with words, its words' sum into sums[i]): the loops
# above as functions, inlined into `norm_parts`
_SEGMENT = r"""
define internal double @{name}(ptr nocapture readonly %p, i64 %n{params}) alwaysinline nounwind {{
body:
  %has = icmp sgt i64 %n, 0
  br i1 %has, label %first, label %tail
{loop}
tail:
  %s = phi double [0.0, %body], [%acc_end, %last]
{tail}
  ret double %s
}}
"""

# norms_in_parts: the norm kernels' work cut into parts that threads claim one at a time
# (`norm_parts`), so that any number of threads (one included) computes the same sums, then each
# tensor's norm (and words' sum) from its segments', in order. `task` holds, as int64: [0] the next
# part to claim (atomic), [1] the parts, then the addresses of [2] each part's first segment
# (parts + 1 of them), [3] each segment's tensor, [4] its first value, [5] its length, [6] the
# tensors' addresses, [7] the segments' float64 sums of squares, [8] their words' sums (0: not
# wanted), [9] where those go when wanted, [10] each tensor's first segment (tensors + 1 of them),
# and [11] the tensors. `team` is OpenMP's GOMP_parallel (null: this thread alone)
_NORM_PARTS = (_SEGMENT.format(name="segment_squares", params="", loop=_SQUARES_LOOP, tail="")
               + _SEGMENT.format(name="segment_words", params=", ptr noalias nocapture %sums, i64 %i",
                                 loop=_WORDS_LOOP, tail=_WORDS_TAIL) + r"""
define void @norm_parts(ptr nocapture %task) nounwind {
entry:
""" + "".join(f"  %f{k}p = getelementptr i64, ptr %task, i64 {k}\n  %f{k} = load i64, ptr %f{k}p\n"
              + ("" if k == 1 else f"  %q{k} = inttoptr i64 %f{k} to ptr\n") for k in range(1, 9)) + r"""  %with_words = icmp ne i64 %f8, 0
  br label %claim
claim:
  %t = atomicrmw add ptr %task, i64 1 monotonic
  %more = icmp slt i64 %t, %f1
  br i1 %more, label %part, label %done
part:
""" + _span("%q2", "%t") + r"""seg:
  %s = phi i64 [%s0, %part], [%s_next, %put]
  %in = icmp slt i64 %s, %s1
  br i1 %in, label %segment, label %claim
segment:
  %tip = getelementptr i64, ptr %q3, i64 %s
  %ti = load i64, ptr %tip
  %bp = getelementptr i64, ptr %q6, i64 %ti
  %base = load i64, ptr %bp
  %offp = getelementptr i64, ptr %q4, i64 %s
  %off = load i64, ptr %offp
  %np = getelementptr i64, ptr %q5, i64 %s
  %n = load i64, ptr %np
  %off4 = shl i64 %off, 2
  %a = add i64 %base, %off4
  %p = inttoptr i64 %a to ptr
  br i1 %with_words, label %w, label %nw
w:
  %sqw = call double @segment_words(ptr %p, i64 %n, ptr %q8, i64 %s)
  br label %put
nw:
  %sqn = call double @segment_squares(ptr %p, i64 %n)
  br label %put
put:
  %sq = phi double [%sqw, %w], [%sqn, %nw]
  %op = getelementptr double, ptr %q7, i64 %s
  store double %sq, ptr %op
  %s_next = add nuw nsw i64 %s, 1
  br label %seg
done:
  ret void
}

define i32 @norms_in_parts(ptr nocapture %task, i64 %addrs, ptr noalias nocapture %out, ptr noalias nocapture %sums, ptr %team, i32 %threads) nounwind {
entry:
  store i64 0, ptr %task
  %f6p = getelementptr i64, ptr %task, i64 6
  store i64 %addrs, ptr %f6p
  %f9p = getelementptr i64, ptr %task, i64 9
  %f9 = load i64, ptr %f9p
  %with_words = icmp ne ptr %sums, null
  %w = select i1 %with_words, i64 %f9, i64 0
  %f8p = getelementptr i64, ptr %task, i64 8
  store i64 %w, ptr %f8p
  %alone = icmp eq ptr %team, null
  br i1 %alone, label %here, label %spread
here:
  call void @norm_parts(ptr %task)
  br label %sum
spread:
  call void %team(ptr @norm_parts, ptr %task, i32 %threads, i32 0)
  br label %sum
sum:
  %f7p = getelementptr i64, ptr %task, i64 7
  %f7 = load i64, ptr %f7p
  %squares = inttoptr i64 %f7 to ptr
  %words = inttoptr i64 %f9 to ptr
  %f10p = getelementptr i64, ptr %task, i64 10
  %f10 = load i64, ptr %f10p
  %first = inttoptr i64 %f10 to ptr
  %f11p = getelementptr i64, ptr %task, i64 11
  %count = load i64, ptr %f11p
  br label %head
head:
  %i = phi i64 [0, %sum], [%i1, %next]
  %ok = phi i32 [1, %sum], [%ok1, %next]
  %more = icmp slt i64 %i, %count
  br i1 %more, label %tensor, label %exit
tensor:
""" + _span("%first", "%i") + r"""seg:
  %s = phi i64 [%s0, %tensor], [%s_next, %seg_body]
  %acc = phi double [0.0, %tensor], [%acc1, %seg_body]
  %ws = phi i64 [0, %tensor], [%ws1, %seg_body]
  %in = icmp slt i64 %s, %s1
  br i1 %in, label %seg_body, label %tensor_end
seg_body:
  %sqp = getelementptr double, ptr %squares, i64 %s
  %sq = load double, ptr %sqp
  %acc1 = fadd double %acc, %sq
  %wp = getelementptr i64, ptr %words, i64 %s
  %wv = load i64, ptr %wp
  %wv_used = select i1 %with_words, i64 %wv, i64 0
  %ws1 = add i64 %ws, %wv_used
  %s_next = add nuw nsw i64 %s, 1
  br label %seg
tensor_end:
  %r = call double @llvm.sqrt.f64(double %acc)
  %v = fptrunc double %r to float
  %op = getelementptr float, ptr %out, i64 %i
  store float %v, ptr %op
  %d = fsub float %v, %v
  %fin = fcmp oeq float %d, 0.0
  %fin32 = zext i1 %fin to i32
  %ok1 = and i32 %ok, %fin32
  br i1 %with_words, label %put_words, label %next
put_words:
  %ws32 = and i64 %ws, 4294967295
  %sp = getelementptr i64, ptr %sums, i64 %i
  store i64 %ws32, ptr %sp
  br label %next
next:
  br label %head
exit:
  ret i32 %ok
}
""")

IR = _TENSOR_NORMS + _NORMS_WORD_SUMS + _NORM_PARTS + r"""
declare double @llvm.sqrt.f64(double)
declare float @llvm.fabs.f32(float)
declare float @llvm.maxnum.f32(float, float)

; values offsets[i] + j * strides[i], j < ks[i], of each float32 tensor at addrs[i], one tensor
; after the other into out
define void @gather_sketch(ptr noalias nocapture readonly %addrs, ptr noalias nocapture readonly %offsets, ptr noalias nocapture readonly %strides, ptr noalias nocapture readonly %ks, ptr noalias nocapture %out, i64 %count) nounwind {
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %tail]
  %o = phi i64 [0, %entry], [%o1, %tail]
  %more = icmp slt i64 %i, %count
  br i1 %more, label %body, label %exit
body:
  %ap = getelementptr i64, ptr %addrs, i64 %i
  %addr = load i64, ptr %ap
  %p = inttoptr i64 %addr to ptr
  %offp = getelementptr i64, ptr %offsets, i64 %i
  %off = load i64, ptr %offp
  %stp = getelementptr i64, ptr %strides, i64 %i
  %st = load i64, ptr %stp
  %kp = getelementptr i64, ptr %ks, i64 %i
  %k = load i64, ptr %kp
  %has = icmp sgt i64 %k, 0
  br i1 %has, label %loop, label %tail
loop:
  %j = phi i64 [0, %body], [%j1, %loop]
  %js = mul i64 %j, %st
  %src = add i64 %off, %js
  %xp = getelementptr float, ptr %p, i64 %src
  %x = load float, ptr %xp
  %dst = add i64 %o, %j
  %yp = getelementptr float, ptr %out, i64 %dst
  store float %x, ptr %yp
  %j1 = add nuw nsw i64 %j, 1
  %c = icmp slt i64 %j1, %k
  br i1 %c, label %loop, label %tail
tail:
  %kk = select i1 %has, i64 %k, i64 0
  %o1 = add i64 %o, %kk
  %i1 = add nuw nsw i64 %i, 1
  br label %head
exit:
  ret void
}

; the wrapping sum of the 32-bit words of the tensor at addrs[i] (words[i] of them), as unsigned
; integers, mod 2^32, added into out[slots[i]]
define void @word_sums(ptr noalias nocapture readonly %addrs, ptr noalias nocapture readonly %words, ptr noalias nocapture readonly %slots, ptr noalias nocapture %out, i64 %count) nounwind {
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %tail]
  %more = icmp slt i64 %i, %count
  br i1 %more, label %body, label %exit
body:
  %ap = getelementptr i64, ptr %addrs, i64 %i
  %addr = load i64, ptr %ap
  %p = inttoptr i64 %addr to ptr
  %np = getelementptr i64, ptr %words, i64 %i
  %n = load i64, ptr %np
  %has = icmp sgt i64 %n, 0
  br i1 %has, label %loop, label %tail
loop:
  %j = phi i64 [0, %body], [%j1, %loop]
  %acc = phi i32 [0, %body], [%acc1, %loop]
  %wp = getelementptr i32, ptr %p, i64 %j
  %w = load i32, ptr %wp
  %acc1 = add i32 %acc, %w
  %j1 = add nuw nsw i64 %j, 1
  %c = icmp slt i64 %j1, %n
  br i1 %c, label %loop, label %tail
tail:
  %s = phi i32 [0, %body], [%acc1, %loop]
  %s64 = zext i32 %s to i64
  %slp = getelementptr i64, ptr %slots, i64 %i
  %slot = load i64, ptr %slp
  %dp = getelementptr i64, ptr %out, i64 %slot
  %d = load i64, ptr %dp
  %d1 = add i64 %d, %s64
  store i64 %d1, ptr %dp
  %i1 = add nuw nsw i64 %i, 1
  br label %head
exit:
  ret void
}

; every value of buf[0, total) multiplied by scale (one float32 product, as mul_), and the L2
; norm of each segment [offsets[i], offsets[i] + lens[i]) as it was before, into out[i]
; (segments ascending, not overlapping)
define void @scaled_norms(ptr noalias nocapture %buf, i64 %total, ptr noalias nocapture readonly %offsets, ptr noalias nocapture readonly %lens, i64 %count, float %scale, ptr noalias nocapture %out) nounwind {
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %tail]
  %pos = phi i64 [0, %entry], [%pos1, %tail]
  %more = icmp slt i64 %i, %count
  br i1 %more, label %body, label %rest
body:
  %offp = getelementptr i64, ptr %offsets, i64 %i
  %off = load i64, ptr %offp
  %lp = getelementptr i64, ptr %lens, i64 %i
  %n = load i64, ptr %lp
  %end = add i64 %off, %n
  %gap = icmp slt i64 %pos, %off
  br i1 %gap, label %gaploop, label %seg
gaploop:
  %g = phi i64 [%pos, %body], [%g1, %gaploop]
  %gp = getelementptr float, ptr %buf, i64 %g
  %gx = load float, ptr %gp
  %gy = fmul float %gx, %scale
  store float %gy, ptr %gp
  %g1 = add nuw nsw i64 %g, 1
  %cg = icmp slt i64 %g1, %off
  br i1 %cg, label %gaploop, label %seg
seg:
  %has = icmp sgt i64 %n, 0
  br i1 %has, label %block, label %tail
block:
  %b0 = phi i64 [%off, %seg], [%bend, %scaled]
  %acc_b = phi double [0.0, %seg], [%acc1, %scaled]
""" + _block_bounds("%end") + _block_squares("%buf", "%scaling") + r"""scaling:
  %k = phi i64 [%b0, %squares], [%k1, %scaling]
  %yp = getelementptr float, ptr %buf, i64 %k
  %y = load float, ptr %yp
  %y1 = fmul float %y, %scale
  store float %y1, ptr %yp
  %k1 = add nuw nsw i64 %k, 1
  %ck = icmp slt i64 %k1, %bend
  br i1 %ck, label %scaling, label %scaled
scaled:
  %cb = icmp slt i64 %bend, %end
  br i1 %cb, label %block, label %tail
tail:
  %s = phi double [0.0, %seg], [%acc1, %scaled]
  %r = call double @llvm.sqrt.f64(double %s)
  %v = fptrunc double %r to float
  %op = getelementptr float, ptr %out, i64 %i
  store float %v, ptr %op
  %pos1 = select i1 %has, i64 %end, i64 %off
  %i1 = add nuw nsw i64 %i, 1
  br label %head
rest:
  %more_r = icmp slt i64 %pos, %total
  br i1 %more_r, label %restloop, label %exit
restloop:
  %q = phi i64 [%pos, %rest], [%q1, %restloop]
  %qp = getelementptr float, ptr %buf, i64 %q
  %qx = load float, ptr %qp
  %qy = fmul float %qx, %scale
  store float %qy, ptr %qp
  %q1 = add nuw nsw i64 %q, 1
  %cq = icmp slt i64 %q1, %total
  br i1 %cq, label %restloop, label %exit
exit:
  ret void
}

declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)

; per unit (column) of a float32 sample matrix m (r rows of w values, rows rs apart): its finite
; count, sum, square sum, zeros, saturated count (|x - centre| >= half, when bounded) and whether
; it is dead (max |x| <= dead_eps), added into column slots[unit] of sums (rows 0-3, 5, 6 of a
; row-major (7, S) float64 array), and its max |x| into absmax[slots[unit]]; a non-finite value
; counts as 0 in all but the finite count. Blocks of 512 columns keep float32 running sums in L1
; while the rows stream past; each column's sums add its rows in order.
define void @forward_sums(ptr noalias nocapture readonly %m, i64 %r, i64 %w, i64 %rs, ptr noalias nocapture readonly %slots, ptr noalias nocapture readonly %centre, ptr noalias nocapture readonly %half, i32 %bounded, double %dead_eps, ptr noalias nocapture %sums, i64 %S, ptr noalias nocapture %absmax) nounwind {
entry:
  %nfin = alloca [512 x float], align 64
  %total = alloca [512 x float], align 64
  %sq = alloca [512 x float], align 64
  %nz = alloca [512 x float], align 64
  %sat = alloca [512 x float], align 64
  %mx = alloca [512 x float], align 64
  %bd = icmp ne i32 %bounded, 0
  %S2 = mul i64 %S, 2
  %S3 = mul i64 %S, 3
  %S5 = mul i64 %S, 5
  %S6 = mul i64 %S, 6
  br label %chead
chead:
  %j0 = phi i64 [0, %entry], [%j0n, %fdone]
  %cm = icmp slt i64 %j0, %w
  br i1 %cm, label %cbody, label %exit
cbody:
  %rem = sub i64 %w, %j0
  %lt = icmp slt i64 %rem, 512
  %b = select i1 %lt, i64 %rem, i64 512
  %bytes = shl i64 %b, 2
  call void @llvm.memset.p0.i64(ptr %nfin, i8 0, i64 %bytes, i1 false)
  call void @llvm.memset.p0.i64(ptr %total, i8 0, i64 %bytes, i1 false)
  call void @llvm.memset.p0.i64(ptr %sq, i8 0, i64 %bytes, i1 false)
  call void @llvm.memset.p0.i64(ptr %nz, i8 0, i64 %bytes, i1 false)
  call void @llvm.memset.p0.i64(ptr %sat, i8 0, i64 %bytes, i1 false)
  call void @llvm.memset.p0.i64(ptr %mx, i8 0, i64 %bytes, i1 false)
  %cp = getelementptr float, ptr %centre, i64 %j0
  %hp = getelementptr float, ptr %half, i64 %j0
  br label %rhead
rhead:
  %ri = phi i64 [0, %cbody], [%ri1, %rnext]
  %rm = icmp slt i64 %ri, %r
  br i1 %rm, label %rbody, label %fin
rbody:
  %rowoff = mul i64 %ri, %rs
  %rowoff2 = add i64 %rowoff, %j0
  %row = getelementptr float, ptr %m, i64 %rowoff2
  br label %jloop
jloop:
  %jj = phi i64 [0, %rbody], [%jj1, %jloop]
  %xp = getelementptr float, ptr %row, i64 %jj
  %x0 = load float, ptr %xp
  %dx = fsub float %x0, %x0
  %finite = fcmp oeq float %dx, 0.0
  %x = select i1 %finite, float %x0, float 0.0
  %one = select i1 %finite, float 1.0, float 0.0
  %p1 = getelementptr float, ptr %nfin, i64 %jj
  %v1 = load float, ptr %p1
  %v1n = fadd float %v1, %one
  store float %v1n, ptr %p1
  %p2 = getelementptr float, ptr %total, i64 %jj
  %v2 = load float, ptr %p2
  %v2n = fadd float %v2, %x
  store float %v2n, ptr %p2
  %xx = fmul float %x, %x
  %p3 = getelementptr float, ptr %sq, i64 %jj
  %v3 = load float, ptr %p3
  %v3n = fadd float %v3, %xx
  store float %v3n, ptr %p3
  %nzb = fcmp une float %x, 0.0
  %nzv = select i1 %nzb, float 1.0, float 0.0
  %p4 = getelementptr float, ptr %nz, i64 %jj
  %v4 = load float, ptr %p4
  %v4n = fadd float %v4, %nzv
  store float %v4n, ptr %p4
  %ax = call float @llvm.fabs.f32(float %x)
  %p6 = getelementptr float, ptr %mx, i64 %jj
  %v6 = load float, ptr %p6
  %v6n = call nnan float @llvm.maxnum.f32(float %ax, float %v6)
  store float %v6n, ptr %p6
  %jj1 = add nuw nsw i64 %jj, 1
  %cj = icmp slt i64 %jj1, %b
  br i1 %cj, label %jloop, label %satq
satq:
  br i1 %bd, label %sloop, label %rnext
sloop:
  %sj = phi i64 [0, %satq], [%sj1, %sloop]
  %sxp = getelementptr float, ptr %row, i64 %sj
  %sx0 = load float, ptr %sxp
  %sdx = fsub float %sx0, %sx0
  %sfin = fcmp oeq float %sdx, 0.0
  %sx = select i1 %sfin, float %sx0, float 0.0
  %scp = getelementptr float, ptr %cp, i64 %sj
  %sc = load float, ptr %scp
  %shp = getelementptr float, ptr %hp, i64 %sj
  %sh = load float, ptr %shp
  %sd = fsub float %sx, %sc
  %sad = call float @llvm.fabs.f32(float %sd)
  %sge = fcmp oge float %sad, %sh
  %sv = select i1 %sge, float 1.0, float 0.0
  %p5 = getelementptr float, ptr %sat, i64 %sj
  %v5 = load float, ptr %p5
  %v5n = fadd float %v5, %sv
  store float %v5n, ptr %p5
  %sj1 = add nuw nsw i64 %sj, 1
  %cs = icmp slt i64 %sj1, %b
  br i1 %cs, label %sloop, label %rnext
rnext:
  %ri1 = add nuw nsw i64 %ri, 1
  br label %rhead
fin:
  br label %floop
floop:
  %fj = phi i64 [0, %fin], [%fj1, %floop]
  %col = add i64 %j0, %fj
  %slp = getelementptr i64, ptr %slots, i64 %col
  %s = load i64, ptr %slp
  %q1 = getelementptr float, ptr %nfin, i64 %fj
  %f1 = load float, ptr %q1
  %q2 = getelementptr float, ptr %total, i64 %fj
  %f2 = load float, ptr %q2
  %q3 = getelementptr float, ptr %sq, i64 %fj
  %f3 = load float, ptr %q3
  %q4 = getelementptr float, ptr %nz, i64 %fj
  %f4 = load float, ptr %q4
  %q5 = getelementptr float, ptr %sat, i64 %fj
  %f5 = load float, ptr %q5
  %q6 = getelementptr float, ptr %mx, i64 %fj
  %f6 = load float, ptr %q6
  %zz = fsub float %f1, %f4
""" + _add_into_sums(((0, "%f1"), (1, "%f2"), (2, "%f3"), (3, "%zz"), (5, "%f5"))) + r"""
  %e6 = fpext float %f6 to double
  %dead = fcmp ole double %e6, %dead_eps
  %dv = select i1 %dead, double 1.0, double 0.0
  %i6x = add i64 %S6, %s
  %a6p = getelementptr double, ptr %sums, i64 %i6x
  %a6 = load double, ptr %a6p
  %a6n = fadd double %a6, %dv
  %a6s = select i1 %dead, double %a6n, double %a6
  store double %a6s, ptr %a6p
  %amp = getelementptr float, ptr %absmax, i64 %s
  %am = load float, ptr %amp
  %agt = fcmp ogt float %f6, %am
  %amn = select i1 %agt, float %f6, float %am
  store float %amn, ptr %amp
  %fj1 = add nuw nsw i64 %fj, 1
  %cf = icmp slt i64 %fj1, %b
  br i1 %cf, label %floop, label %fdone
fdone:
  %j0n = add i64 %j0, %b
  br label %chead
exit:
  ret void
}

; rows r of u float32 values from address sa, its rows ss values apart, to address da, its rows
; ds apart: a forward sample's rows
define void @copy_rows1(i64 %sa, i64 %ss, i64 %da, i64 %ds, i64 %r, i64 %u) nounwind {
entry:
  %s = inttoptr i64 %sa to ptr
  %d = inttoptr i64 %da to ptr
  %bytes = shl i64 %u, 2
  %any = icmp sgt i64 %r, 0
  br i1 %any, label %row, label %exit
row:
  %a = phi i64 [0, %entry], [%a1, %row]
  %so = mul i64 %a, %ss
  %src = getelementptr float, ptr %s, i64 %so
  %do = mul i64 %a, %ds
  %dst = getelementptr float, ptr %d, i64 %do
  call void @llvm.memcpy.p0.p0.i64(ptr %dst, ptr %src, i64 %bytes, i1 false)
  %a1 = add nuw nsw i64 %a, 1
  %c = icmp slt i64 %a1, %r
  br i1 %c, label %row, label %exit
exit:
  ret void
}

declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

; copy_rows1 for each i < n: from source address srcs[i], with the other five arguments in
; table[5 * i ...] (its row stride, destination address, its row stride, rows, values a row):
; a forward pass's samples in one call
define void @copy_rows_many(ptr noalias nocapture readonly %srcs, ptr noalias nocapture readonly %table, i64 %n) nounwind {
entry:
  %any = icmp sgt i64 %n, 0
  br i1 %any, label %each, label %exit
each:
  %i = phi i64 [0, %entry], [%i1, %each]
  %sp = getelementptr i64, ptr %srcs, i64 %i
  %sa = load i64, ptr %sp
  %base = mul i64 %i, 5
  %p0 = getelementptr i64, ptr %table, i64 %base
  %ss = load i64, ptr %p0
  %p1 = getelementptr i64, ptr %p0, i64 1
  %da = load i64, ptr %p1
  %p2 = getelementptr i64, ptr %p0, i64 2
  %ds = load i64, ptr %p2
  %p3 = getelementptr i64, ptr %p0, i64 3
  %r = load i64, ptr %p3
  %p4 = getelementptr i64, ptr %p0, i64 4
  %u = load i64, ptr %p4
  call void @copy_rows1(i64 %sa, i64 %ss, i64 %da, i64 %ds, i64 %r, i64 %u)
  %i1 = add nuw nsw i64 %i, 1
  %more = icmp slt i64 %i1, %n
  br i1 %more, label %each, label %exit
exit:
  ret void
}

; the factor c > 0 with after[i] = c * before[i] for each i < n, read off the largest |before[i]|
; and checked in float64 on every value: |after[i] - c * before[i]| <= tol * |after[i]| + the
; smallest normal float32 (a product that underflowed), after[i] finite (a NaN fails every
; comparison); 0 where there is none (nothing but zeros, a zero where the other is not, any
; other change)
define double @one_factor(ptr noalias nocapture readonly %before, ptr noalias nocapture readonly %after, i64 %n, double %tol) nounwind {
entry:
  %any = icmp sgt i64 %n, 0
  br i1 %any, label %find, label %none
find:
  %i = phi i64 [0, %entry], [%i1, %find]
  %bi = phi i64 [0, %entry], [%bi1, %find]
  %bv = phi float [0.0, %entry], [%bv1, %find]
  %pb = getelementptr float, ptr %before, i64 %i
  %b = load float, ptr %pb
  %ab = call float @llvm.fabs.f32(float %b)
  %gt = fcmp ogt float %ab, %bv
  %bi1 = select i1 %gt, i64 %i, i64 %bi
  %bv1 = select i1 %gt, float %ab, float %bv
  %i1 = add nuw nsw i64 %i, 1
  %more = icmp slt i64 %i1, %n
  br i1 %more, label %find, label %found
found:
  %nz = fcmp ogt float %bv1, 0.0
  br i1 %nz, label %ratio, label %none
ratio:
  %pb0 = getelementptr float, ptr %before, i64 %bi1
  %b0 = load float, ptr %pb0
  %pa0 = getelementptr float, ptr %after, i64 %bi1
  %a0 = load float, ptr %pa0
  %b0d = fpext float %b0 to double
  %a0d = fpext float %a0 to double
  %c = fdiv double %a0d, %b0d
  %pos = fcmp ogt double %c, 0.0
  %fin = fcmp olt double %c, 0x7FF0000000000000
  %usable = and i1 %pos, %fin
  br i1 %usable, label %check, label %none
check:
  %j = phi i64 [0, %ratio], [%j1, %next]
  %pbj = getelementptr float, ptr %before, i64 %j
  %bj = load float, ptr %pbj
  %paj = getelementptr float, ptr %after, i64 %j
  %aj = load float, ptr %paj
  %bjd = fpext float %bj to double
  %ajd = fpext float %aj to double
  %pred = fmul double %bjd, %c
  %diff = fsub double %ajd, %pred
  %off = call double @llvm.fabs.f64(double %diff)
  %mag = call double @llvm.fabs.f64(double %ajd)
  %rel = fmul double %mag, %tol
  %lim = fadd double %rel, 0x3810000000000000
  %close = fcmp ole double %off, %lim
  %finite = fcmp olt double %mag, 0x7FF0000000000000
  %good = and i1 %close, %finite
  br i1 %good, label %next, label %none
next:
  %j1 = add nuw nsw i64 %j, 1
  %jm = icmp slt i64 %j1, %n
  br i1 %jm, label %check, label %done
done:
  ret double %c
none:
  ret double 0.0
}

declare double @llvm.fabs.f64(double)

; the parameters' sketch arithmetic of K steps, in float32 and in the order of the eager ops it
; replaces (ParamProbe.reduce), so the sums are the same bit for bit: for each coordinate j in
; turn, and each step s, from the float32 rows of f (the sketch at the step's first forward) and
; e (after its optimizer step), rs values apart: the update u = e - f, the update before pu (for
; the first step the carried cu[j]), the drift d = f - (for the first step the carried cs[j], else
; the step before's e); u*u, u*pu, pu*pu and d*d, each times scale[j], added into
; out[(comp[j] * 4 + q) * K + s] (zeroed first). Then cu[j] and cs[j] carry the last step's u and e.
define void @sketch_sums(ptr noalias nocapture readonly %f, ptr noalias nocapture readonly %e, i64 %rs, ptr noalias nocapture %cu, ptr noalias nocapture %cs, ptr noalias nocapture readonly %scale, ptr noalias nocapture readonly %comp, i64 %K, i64 %k, i64 %n, ptr noalias nocapture %out) nounwind {
entry:
  %K4 = shl i64 %K, 2
  %cells = mul i64 %n, %K4
  %bytes = shl i64 %cells, 2
  call void @llvm.memset.p0.i64(ptr %out, i8 0, i64 %bytes, i1 false)
  br label %jhead
jhead:
  %j = phi i64 [0, %entry], [%j1, %jtail]
  %jm = icmp slt i64 %j, %k
  br i1 %jm, label %jbody, label %exit
jbody:
  %cp = getelementptr i64, ptr %comp, i64 %j
  %c = load i64, ptr %cp
  %cbase = mul i64 %c, %K4
  %scp = getelementptr float, ptr %scale, i64 %j
  %sc = load float, ptr %scp
  %cup = getelementptr float, ptr %cu, i64 %j
  %cu0 = load float, ptr %cup
  %csp = getelementptr float, ptr %cs, i64 %j
  %cs0 = load float, ptr %csp
  br label %shead
shead:
  %s = phi i64 [0, %jbody], [%s1, %sbody]
  %pu = phi float [%cu0, %jbody], [%u, %sbody]
  %pe = phi float [%cs0, %jbody], [%ev, %sbody]
  %sm = icmp slt i64 %s, %K
  br i1 %sm, label %sbody, label %jtail
sbody:
  %row = mul i64 %s, %rs
  %at = add i64 %row, %j
  %fp = getelementptr float, ptr %f, i64 %at
  %fv = load float, ptr %fp
  %ep = getelementptr float, ptr %e, i64 %at
  %ev = load float, ptr %ep
  %u = fsub float %ev, %fv
  %d = fsub float %fv, %pe
  %p0 = fmul float %u, %u
  %p1 = fmul float %u, %pu
  %p2 = fmul float %pu, %pu
  %p3 = fmul float %d, %d
  %q0 = fmul float %p0, %sc
  %q1 = fmul float %p1, %sc
  %q2 = fmul float %p2, %sc
  %q3 = fmul float %p3, %sc
  %o0 = add i64 %cbase, %s
  %o1 = add i64 %o0, %K
  %o2 = add i64 %o1, %K
  %o3 = add i64 %o2, %K
""" + "".join(_add_to("%out", f"%o{q}", f"%q{q}", f"%a{q}") for q in range(4)) + r"""  %s1 = add nuw nsw i64 %s, 1
  br label %shead
jtail:
  store float %pu, ptr %cup
  store float %pe, ptr %csp
  %j1 = add nuw nsw i64 %j, 1
  br label %jhead
exit:
  ret void
}
"""

_I64, _PTR, _I32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32
# each function's C signature: (return type, argument types)
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "tensor_norms": (_I32, (_PTR, _PTR, _PTR, _I64)),
    "gather_sketch": (None, (_PTR, _PTR, _PTR, _PTR, _PTR, _I64)),
    "word_sums": (None, (_PTR, _PTR, _PTR, _PTR, _I64)),
    "norms_word_sums": (_I32, (_PTR, _PTR, _PTR, _PTR, _I64)),
    "norm_parts": (None, (_PTR,)),
    "norms_in_parts": (_I32, (_PTR, _I64, _PTR, _PTR, _PTR, ctypes.c_uint32)),
    "scaled_norms": (None, (_PTR, _I64, _PTR, _PTR, _I64, ctypes.c_float, _PTR)),
    "forward_sums": (None, (_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I32, ctypes.c_double, _PTR, _I64, _PTR)),
    "copy_rows1": (None, (_I64, _I64, _I64, _I64, _I64, _I64)),
    "one_factor": (ctypes.c_double, (_PTR, _PTR, _I64, ctypes.c_double)),
    "copy_rows_many": (None, (_PTR, _PTR, _I64)),
    "sketch_sums": (None, (_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR)),
}
