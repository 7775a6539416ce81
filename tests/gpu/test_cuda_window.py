"""GroupQueryAttention's ``local_window_size`` on CUDA (float16, its only attention types there):
the value the graph writes must give a query the same keys as on the CPU, p - window + 1 .. p,
with Gemma 3's head size as well as a small one (tests/gqa_window.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gqa_window import Probe

from services.modelbuild.decoder_graph import local_window_size


@pytest.mark.parametrize(("window", "head"), [(4, 8), (512, 256)])
def test_local_window_size_sees_exactly_the_window_on_cuda(window, head):
    probe = Probe(head=head, provider="CUDAExecutionProvider", dtype=np.dtype(np.float16))
    chosen = local_window_size(window)
    assert probe.matches(chosen, window, atol=2e-2)
    assert not probe.matches(chosen - 1, window, atol=2e-2) and not probe.matches(chosen + 1, window, atol=2e-2)
