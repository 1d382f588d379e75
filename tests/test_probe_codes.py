"""The probe's comparison of FP8-stored caches (``passes.validate.Quantized``, ``code_error``): written values in
e4m3 code steps, at most one step (no step below a BF16 ulp of the row's largest value), at most 1/8 of the
written codes moved (docs/design.md §4.4).

A cache of 80 rows of 128 codes with a power-of-two scale a row (as the DSA index keys); stock writes 64 of them.
Roundings pass: one code a step off, a row whose amax crossed a power of two (its scale doubled, its codes
requantized), near-zero codes many fine steps off but within the row's ulp (a normalization's input an ulp
apart). Wrong writes fail: every code a step toward zero (beside filler rows of larger values), a row left
unwritten, a row written to another slot, codes zeroed under a huge scale (the replacement's own grid is no unit),
a NaN on either side.
"""

from __future__ import annotations

import torch

from dep_compile.passes.validate import CODE_MAX_MOVED, CODE_ROW_ULP, Quantized, _over, code_error

from helpers import step_toward_zero

F8 = torch.float8_e4m3fn
T, D, NB = 64, 128, 80


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` as e4m3 codes with the smallest power-of-two scale that fits them (the stock quantizer)."""
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-12) / 448)))
    return (x / scale[:, None]).clamp(-448, 448).to(F8), scale


class Case:
    """A drawn cache, this step's keys and slots, and stock's write of them."""

    def __init__(self, seed: int = 0, row_floor: float = CODE_ROW_ULP):
        g = torch.Generator().manual_seed(seed)
        self.codes = (torch.randn(NB, D, generator=g) * 64).clamp(-448, 448).to(F8)  # filler: larger values
        self.scales = torch.randn(NB, generator=g).abs() * 8 + 1
        self.slots = torch.randperm(NB, generator=g)[:T]
        self.x = torch.randn(T, D, generator=g)
        self.row_floor = row_floor
        self.before = Quantized(self.codes.clone(), self.scales.clone(), row_floor)
        self.ref = self.write(*_quantize(self.x))

    def write(self, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor | None = None) -> Quantized:
        c, s = self.codes.clone(), self.scales.clone()
        c[self.slots if slots is None else slots], s[self.slots if slots is None else slots] = codes, scales
        return Quantized(c, s, self.row_floor)

    def refused(self, got: Quantized, ref: Quantized | None = None) -> bool:
        return _over(code_error(got, self.ref if ref is None else ref, self.before), on_cpu=True, rms=0.0)


def test_roundings_pass():
    c = Case()
    codes, scales = _quantize(c.x)
    assert code_error(c.write(codes, scales), c.ref, c.before).max == 0.0
    one = torch.zeros(T, D, dtype=torch.bool)
    one[3, 5] = True
    e = code_error(c.write(step_toward_zero(codes, one), scales), c.ref, c.before)
    assert e.max == 1.0 and 0 < e.spread < CODE_MAX_MOVED and not c.refused(c.write(step_toward_zero(codes, one),
                                                                                         scales))
    # row 0's amax an ulp above a power of two: its scale doubles, and its subnormal codes (values below 2^-6 of
    # the scale, here 16 of them) fall on a grid twice as coarse
    c.x[0, :16] = scales[0] * 2.0 ** -9 * torch.linspace(0.3, 7.7, 16)
    c.ref = c.write(*_quantize(c.x))
    codes, scales = _quantize(c.x)
    doubled = codes.clone(), scales.clone()
    doubled[1][0] *= 2
    doubled[0][0] = (c.x[0] / doubled[1][0]).to(F8)
    e = code_error(c.write(*doubled), c.ref, c.before)
    assert 0 < e.max <= 1.0 and not c.refused(c.write(*doubled)), e


def _near_zero_moved(c: Case, by: float) -> Quantized:
    """Stock's write with row 3 (its largest value 2^-6 of the other rows': the floor is its own) and its first 8
    values set near zero (fine e4m3 steps there), then moved by ``by`` row ulps (``CODE_ROW_ULP`` of the row's
    largest value) and requantized."""
    c.x[3] *= 2.0 ** -6 * c.x.abs().max() / c.x[3].abs().max()
    c.x[3, :8] = c.x[3].abs().max() * 2.0 ** -12 * torch.linspace(-1, 1, 8)
    c.ref = c.write(*_quantize(c.x))
    codes, scales = _quantize(c.x)
    row = codes[3].float() * scales[3]
    codes[3, :8] = ((row[:8] + by * CODE_ROW_ULP * row.abs().max()) / scales[3]).to(F8)
    return c.write(codes, scales)


def test_near_zero_codes_within_a_row_ulp_pass():
    """A one-ulp difference before a normalization moves its near-zero outputs by many fine e4m3 steps (H200, 64
    requests x q = 2: 3 steps at 0.1 % of the index codes): within a row ulp they pass where the cache has the row
    floor (the index keys); without it (the latent rows) they fail."""
    c = Case()
    got = _near_zero_moved(c, 0.9)
    e = code_error(got, c.ref, c.before)
    assert 0 < e.max <= 1.0 and not c.refused(got), e
    c = Case(row_floor=0.0)
    got = _near_zero_moved(c, 0.9)
    assert c.refused(got), code_error(got, c.ref, c.before)


def test_near_zero_codes_past_a_row_ulp_refused():
    """Past the row's own ulp (a floor from the largest row of the cache would pass it: 64 times larger)."""
    c = Case()
    got = _near_zero_moved(c, 2.5)
    assert c.refused(got), code_error(got, c.ref, c.before)


def test_truncating_quantizer_refused_beside_larger_filler():
    c = Case()
    codes, scales = _quantize(c.x)
    e = code_error(c.write(step_toward_zero(codes, torch.ones(T, D, dtype=torch.bool)), scales), c.ref, c.before)
    assert e.max == 1.0 and e.spread > 0.9 and e.spread > CODE_MAX_MOVED


def test_wrong_writes_refused():
    c = Case()
    codes, scales = _quantize(c.x)
    keep = torch.ones(T, dtype=torch.bool)
    keep[7] = False  # row 7 not written
    c_unwritten = c.codes.clone(), c.scales.clone()
    c_unwritten[0][c.slots[keep]], c_unwritten[1][c.slots[keep]] = codes[keep], scales[keep]
    assert c.refused(Quantized(*c_unwritten))
    other = c.slots.clone()
    other[7] = next(i for i in range(NB) if i not in set(c.slots.tolist()))  # row 7 to an unused slot
    assert c.refused(c.write(codes, scales, other))
    huge = codes.clone(), scales.clone()  # 4 rows: codes 0 under a scale of 1e6 (a step of ~2000 by its own grid)
    huge[0][:4], huge[1][:4] = 0.0, 1e6
    assert c.refused(c.write(*huge)), code_error(c.write(*huge), c.ref, c.before)


def test_nan_on_either_side_refused():
    c = Case()
    codes, scales = _quantize(c.x)
    nan_scales = scales.clone()
    nan_scales[0] = float("nan")
    assert c.refused(c.write(codes, nan_scales))
    assert c.refused(c.write(codes, scales), ref=c.write(codes, nan_scales))
