"""Sign flips as a computed view: a part's values negated, or conjugated, as they are
read (a torch tensor saved with its negative or conjugate bit set: `x.conj()`, and
`x.conj().imag`, whose values torch negates as it reads them).

Negation is NumPy's, which flips the sign bit of a float (NaN too) and wraps an int
(`-(-128)` is -128 in int8), as torch's does for every value but some NaNs: torch
negates bfloat16 and float16 through float32, and its scalar loop (a tensor shorter
than its vector width, and the elements left after the vectors) turns every bfloat16
NaN into 0x7FC0 and quiets a float16 signaling NaN, where its vectorized loop flips
the sign bit as NumPy does. Which loop an element takes depends on its position and
the machine, so NaN bits can differ there (the format notes say so). The conjugate
flips the sign of the imaginary part, and the negative of a conjugate that of the
real part."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from lazyckpt._array.compose import Computed, Part, view_chunks
from lazyckpt._array.geometry import Box


@attrs.frozen(eq=False)
class SignFlipped(Computed):
    """`array` with the sign of its values flipped (`real`; a real value's only
    part), and of their imaginary parts (`imag`, complex values only)."""

    array: Part
    real: bool
    imag: bool

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.array,)

    @property
    def chunks(self) -> tuple[int, ...]:
        return view_chunks(self.array)

    def inputs(self, box: Box) -> tuple[Box, ...]:
        return (box,)

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        flipped = values[0]
        if self.real:
            np.negative(flipped.real, out=flipped.real)
        if self.imag:
            np.negative(flipped.imag, out=flipped.imag)
        np.copyto(out, flipped, casting="unsafe")

    def describe(self) -> str:
        if not self.imag:
            return "real parts negated" if self.dtype.kind == "c" else "negated"
        return "negated" if self.real else "conjugated"
