"""A per-element reading of the MXFP4 format (OCP MX spec), the reference the converter's
dequantization and the MXFP4 model tests are checked against."""

import numpy as np

E2M1 = {  # code -> value, from the OCP MX spec: sign, 2 exponent bits, 1 mantissa bit
    c: (-1.0 if c & 8 else 1.0)
    * ((c & 1) * 0.5 if (c >> 1) & 3 == 0 else (1 + (c & 1) * 0.5) * 2.0 ** (((c >> 1) & 3) - 1))
    for c in range(16)
}


def naive_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One element at a time: element i of row (e, o) is in block i // 32, byte (i % 32) // 2,
    low nibble for even i; the dense layout is [E, in, out]."""
    E, out, groups, _ = blocks.shape
    dense = np.zeros((E, groups * 32, out), np.float64)
    for e in range(E):
        for o in range(out):
            for i in range(groups * 32):
                byte = int(blocks[e, o, i // 32, (i % 32) // 2])
                code = byte & 0x0F if i % 2 == 0 else byte >> 4
                dense[e, i, o] = E2M1[code] * 2.0 ** (int(scales[e, o, i // 32]) - 127)
    return dense
