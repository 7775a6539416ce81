"""Sample-rate conversion of mono float audio in numpy: a polyphase windowed-sinc filter.

The filter follows the design of FFmpeg's libswresample with its default options, the resampler
behind faster-whisper's ``decode_audio`` (PyAV), so that both read a file alike: a sinc cut off at
``CUTOFF`` of the lower of the two Nyquist frequencies, ``FILTER_SIZE`` taps at the lower rate's
spacing (rounded up to an even count at the input's), a Kaiser window of beta ``KAISER_BETA``.
When ``out/in`` reduces to a fraction whose numerator is at most ``MAX_PHASES`` every output
sample gets its exact filter phase (44.1 kHz -> 16 kHz: 160 phases; 48 kHz -> 16 kHz: one);
otherwise the filter is tabulated at ``MAX_PHASES`` phases and interpolated linearly between the
two nearest. Each phase is normalised to unit gain at 0 Hz, so a constant stays that constant.

Output sample ``k`` is the input at time ``k * in / out`` (input samples); there are
``ceil(n * out / in)`` of them. The input is extended by its reflection about the first sample
(``x[-j] = x[j]``) and its mirror after the last (``x[n - 1 + j] = x[n - j]``), as libswresample
does, so there is neither a fade-in nor a tail. Deterministic: plain float64 numpy arithmetic in a
fixed order.

Memory: the output, a filter table of at most ``(MAX_PHASES + 1) x taps`` (taps: 32 x in/out x
1/CUTOFF: 396 at 192 kHz -> 16 kHz, 3.3 MB), the input with its padding, and per block of
``BLOCK`` output samples a few arrays of that size.
"""

from __future__ import annotations

import math

import numpy as np

FILTER_SIZE = 32
CUTOFF = 0.97
KAISER_BETA = 9.0
MAX_PHASES = 1024
BLOCK = 1 << 15


def _filter_bank(factor: float, taps: int, phases: int) -> np.ndarray:
    """``[phases + 1, taps]``: row ``p`` weighs input samples at offsets ``i - centre - p / phases``
    from the output's time (row ``phases`` is row 0 one sample later, for the interpolation)."""
    centre = (taps - 1) // 2
    offsets = (np.arange(taps) - centre)[None, :] - (np.arange(phases + 1) / phases)[:, None]
    edge = 2.0 * offsets / taps
    window = np.i0(KAISER_BETA * np.sqrt(np.maximum(1.0 - edge * edge, 0.0)))
    bank = np.sinc(offsets * factor) * window
    return bank / bank.sum(axis=1, keepdims=True)


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """``samples`` (1-D, float) at ``rate_in`` Hz as float32 at ``rate_out`` Hz."""
    if rate_in == rate_out or not len(samples):
        return samples.astype(np.float32, copy=False)
    common = math.gcd(rate_in, rate_out)
    up, down = rate_out // common, rate_in // common
    factor = min(1.0, rate_out * CUTOFF / rate_in)
    taps = max(math.ceil(FILTER_SIZE / factor), 2)
    taps += taps % 2
    centre = (taps - 1) // 2
    phases = min(up, MAX_PHASES)
    bank = _filter_bank(factor, taps, phases).T.copy()  # [taps, phases + 1]: one tap's phases in a row
    x = np.pad(samples.astype(np.float64), (centre, 0), mode="reflect")
    x = np.pad(x, (0, taps - centre), mode="symmetric")
    count = -(-len(samples) * up // down)
    out = np.empty(count, dtype=np.float32)
    for start in range(0, count, BLOCK):
        n = np.arange(start, min(start + BLOCK, count), dtype=np.int64)
        first, remainder = np.divmod(n * down, up)  # the first tap's input index (padded), phase
        position = remainder * (phases / up)
        phase = np.minimum(position.astype(np.int64), phases - 1)
        weight = position - phase
        acc = np.zeros(len(n))
        for i in range(taps):
            coefficient = bank[i, phase]
            if phases < up:
                coefficient += weight * (bank[i, phase + 1] - coefficient)
            acc += coefficient * x[first + i]
        out[start:start + len(n)] = acc
    return out
