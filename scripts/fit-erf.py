#!/usr/bin/env python3
"""Prints the coefficients of the float32 erf in agent/engine/src/backend/cpu/vmath.rs and its
worst error, evaluated in float32 (pure Python, no packages).

Two pieces, each a Chebyshev interpolant turned into a power series:
  |x| <= 1:     erf(x) = x * P(x^2),       P interpolating erf(sqrt(s)) / sqrt(s) on s in [0, 1];
  1 < |x| < 4:  erf(x) = 1 - exp(Q(u) - x^2), u = (2|x| - 5) / 3, Q interpolating ln(erfc(x)) + x^2,
                which is small and smooth (erfc(x) ~ exp(-x^2) / (x sqrt(pi))), so float32 keeps it;
  |x| >= 4:     1 (erfc(4) = 1.5e-8, below half an ulp of 1).
P[0] comes out within one float32 ulp of 2/sqrt(pi), the series' leading term; the Rust code uses
that constant (worst error then 1.45e-7 on |x| <= 1).
"""
import math
import struct


def f32(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def chebyshev(f, degree):
    """Coefficients of the interpolant of f on [-1, 1] at degree + 1 Chebyshev nodes."""
    n = degree + 1
    nodes = [math.cos(math.pi * (k + 0.5) / n) for k in range(n)]
    values = [f(x) for x in nodes]
    return [(2.0 / n) * sum(values[k] * math.cos(math.pi * j * (k + 0.5) / n) for k in range(n)) * (0.5 if j == 0 else 1.0)
            for j in range(n)]


def powers_of(c, a, b):
    """sum c_j T_j(a*y + b) as coefficients of powers of y."""
    t = [[1.0], [b, a]]
    for _ in range(2, len(c)):
        prev, prev2 = t[-1], t[-2]
        nxt = [0.0] * (len(prev) + 1)
        for i, v in enumerate(prev):
            nxt[i] += 2 * b * v
            nxt[i + 1] += 2 * a * v
        for i, v in enumerate(prev2):
            nxt[i] -= v
        t.append(nxt)
    out = [0.0] * len(c)
    for j, cj in enumerate(c):
        for i, v in enumerate(t[j]):
            out[i] += cj * v
    return out


def horner(c, y):
    p = c[-1]
    for a in reversed(c[:-1]):
        p = f32(f32(p * y) + a)
    return p


def small(s_unit):
    s = (s_unit + 1) / 2
    return 2 / math.sqrt(math.pi) if s == 0 else math.erf(math.sqrt(s)) / math.sqrt(s)


def large(u):
    x = (3 * u + 5) / 2
    return math.log(math.erfc(x)) + x * x


# P in s = x^2 (u = 2s - 1); Q in u itself.
P = [f32(v) for v in powers_of(chebyshev(small, 6), 2.0, -1.0)]
Q = [f32(v) for v in powers_of(chebyshev(large, 8), 1.0, 0.0)]


def erf32(x):
    a = abs(x)
    if a <= 1:
        return f32(horner(P, f32(x * x)) * x)
    u = f32(f32(2 * min(a, 4.0) - 5) / 3)
    y = f32(1 - f32(math.exp(f32(horner(Q, u) - f32(a * a)))))
    return math.copysign(y, x)


worst = max(abs(erf32(f32(-6 + 12 * i / 120000)) - math.erf(f32(-6 + 12 * i / 120000))) for i in range(120001))
print("P (|x| <= 1, powers of x^2):", ", ".join("%.9e" % v for v in P))
print("Q (1 < |x| < 4, powers of u):", ", ".join("%.9e" % v for v in Q))
print("worst |error| on [-6, 6] in float32 (exp exact):", "%.3g" % worst)
