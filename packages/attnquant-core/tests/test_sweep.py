"""The G x r sweep: theta errors match real decompositions, the SVD baseline matches numpy."""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_core import analyze_checkpoint, open_checkpoint, sweep


@pytest.fixture
def ckpt(checkpoint):
    return open_checkpoint(checkpoint(4))


def test_sweep_matches_decomposition_and_exact_svd(ckpt):
    result = sweep(ckpt, blocks=[1, 2, "layers"], ranks=[0, 2, 6])
    for G in (1, 2, 4):
        for r in (0, 2, 6):
            report = analyze_checkpoint(ckpt, blocks=G, rank=r)
            total = next(p for p in result.totals() if (p.blocks, p.rank) == (G, r))
            assert total.error == pytest.approx(report.error, rel=1e-4, abs=1e-6)
            assert total.stored == report.stored
            for name, fam in report.families.items():
                point = next(
                    p for p in result.points if (p.family, p.blocks, p.rank) == (name, G, r)
                )
                assert point.error == pytest.approx(fam.error, rel=1e-4, abs=1e-6)
                assert point.stored == fam.stored
                # The baseline: per-layer SVD at the largest rank that fits the same budget.
                out_dim, in_dim = fam.shape
                k = point.svd_rank
                assert 4 * k * (out_dim + in_dim) <= point.stored
                assert k == min(out_dim, in_dim) or 4 * (k + 1) * (out_dim + in_dim) > point.stored
                info = ckpt.families[name]
                num = den = 0.0
                for key in info.keys:
                    W = ckpt.get(key).astype(np.float64)
                    S = np.linalg.svd(W, compute_uv=False)
                    num += np.sum(S[k:] ** 2)
                    den += np.sum(W**2)
                assert point.svd_error == pytest.approx(np.sqrt(num / den), rel=1e-4, abs=1e-6)


def test_passthrough_points_are_exact_and_curve_is_monotone(ckpt):
    result = sweep(ckpt, blocks=["layers"], ranks=[0])
    assert all(p.error == pytest.approx(0.0, abs=1e-6) for p in result.points)
    errors = [c["error"] for c in result.svd_curve]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] == pytest.approx(0.0, abs=1e-6)
    assert result.svd_curve[0]["rank"] == 0
