"""The attention backward's two walks (kernels/flash_attention_bwd.py): each kernel visits the blocks that need
per-element masks (the causal diagonal band, the window's edge, the sequences' last partial blocks, packed rows)
in one loop and the blocks that need none (no comparison per score, no bounds on the loads) in another. A block
put in the wrong loop reads past a sequence or keeps a masked score, so these run the interpreter over lengths
that are not multiples of the tiles, end-aligned causal with Sq != Sk, windows whose edge falls inside a tile,
key padding and packed rows, at two tile shapes each (the dK/dV kernel stepping over thin and over wide query
blocks), and check Triton against the torch reference and the reference against float64.
"""
import pytest
import torch

from tests.kernels.test_attention_packed import doc_ids
from tests.kernels.test_attention_window import check_window_vs_ref
from tests.kernels.test_flash_attention import F16, F32, attention_mod, make_inputs

# (Sq, Sk, causal, mask, window, packed, dtype)
CASES = [
    (75, 75, True, None, None, False, F32),  # causal at an odd length: a diagonal band, full blocks below it
    (75, 99, True, "pad", None, False, F32),  # Sq < Sk: the diagonal starts 24 keys in
    (99, 70, True, None, None, False, F16),  # Sq > Sk: the first 29 rows see no key
    (99, 75, False, "random", None, False, F16),  # not causal: masked only at the last partial blocks
    (64, 96, False, None, None, False, F16),  # tile multiples: every block in the unmasked loop
    (90, 90, True, None, 20, False, F32),  # a window: masked at its edge and on the diagonal, full between
    (90, 90, False, "pad", 41, False, F16),  # a window without causal: two masked edges per row
    (83, 83, True, "pad", 37, True, F16),  # packed rows with a window: every block masked
]


def _ids(c):
    Sq, Sk, causal, mask, window, packed, dtype = c
    return (f"q{Sq}k{Sk}-{'causal' if causal else 'full'}-{mask or 'nomask'}{f'-w{window}' if window else ''}"
            f"{'-packed' if packed else ''}-{str(dtype)[6:]}")


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=["m16n32", "m32n16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_walks_match_reference_and_float64(monkeypatch, case, blocks):
    real = attention_mod._config
    monkeypatch.setattr(attention_mod, "_config",
                        lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=blocks[0], BLOCK_N=blocks[1]))
    Sq, Sk, causal, mask, window, packed, dtype = case
    q, k, v, m = make_inputs(2, 4, Sq, Sk, 16, dtype, mask, Hkv=2, seed=Sq + Sk)
    docs = None
    if packed:
        docs = (doc_ids([30, 1, 33, 19], [83]),) * 2
    check_window_vs_ref(q, k, v, causal, window, docs=docs, mask=m)


def test_backward_tiles_are_the_launchers(monkeypatch):
    """The dK/dV and dQ launches take their own tables' tiles: BLOCK_N keys per dK/dV program, BLOCK_M queries
    per dQ program (the grids' sizes say which tile each launch used)."""
    seen = []
    real = attention_mod._config

    def tiles(head_dim, dtype, kernel="fwd", docs=False):
        cfg = real(head_dim, dtype, kernel, docs)
        return dict(cfg, **{"fwd": dict(BLOCK_M=32, BLOCK_N=16), "dkdv": dict(BLOCK_M=16, BLOCK_N=64),
                            "dq": dict(BLOCK_M=64, BLOCK_N=16)}[kernel])

    for name in ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        kern = getattr(attention_mod, name)

        class Spy:
            def __init__(self, kern, name):
                self.kern, self.name = kern, name

            def __getitem__(self, grid):
                seen.append((self.name, grid))
                return self.kern[grid]
        monkeypatch.setattr(attention_mod, name, Spy(kern, name))
    monkeypatch.setattr(attention_mod, "_config", tiles)
    q, k, v, _ = make_inputs(1, 2, 130, 130, 16, F32)
    check_window_vs_ref(q, k, v, True, None)
    assert dict(seen) == {"attn_bwd_dkdv_kernel": (3 * 2,), "attn_bwd_dq_kernel": (3 * 2,)}
    with pytest.raises(ValueError, match="kernel must be one of"):
        real(64, F16, "bwd")
