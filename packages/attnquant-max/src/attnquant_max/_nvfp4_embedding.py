"""The embedding table in NVFP4 (``--quant-embedding``): :class:`NVFP4Embedding`, a token
lookup over packed rows (:func:`attnquant_max._nvfp4_graph.gather_nvfp4_rows`), its own table
or a tied model's NVFP4 head."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, TensorValue
from max.nn import Module

from attnquant_core.forms import check_nvfp4_shape

from ._nvfp4_graph import NVFP4Band, gather_nvfp4_rows
from ._nvfp4_layers import _hold_packed

__all__ = ["NVFP4Embedding"]


class NVFP4Embedding(Module):
    """An embedding lookup over an NVFP4 table ``[vocab, hidden]`` (``--quant-embedding``): the
    tokens' rows gathered packed (4.5 bits a weight) and decoded in the graph
    (:func:`gather_nvfp4_rows`), each exactly its row of
    :func:`attnquant_core.forms.dequantize_nvfp4`.

    Parameters
    ----------
    vocab_size, hidden_dim : int
        The table is ``[vocab_size, hidden_dim]``; ``hidden_dim`` a multiple of 16.
    dtype : DType
        The activation dtype the rows are cast to.
    device : DeviceRef
    band : NVFP4Band, optional
        A table held elsewhere: a tied model's NVFP4 head (``lm_head``), so the model holds
        its 4-bit bytes once. ``None``: the module owns ``weight``, ``weight_scale``,
        ``weight_scale_2`` (``embed_tokens.*``).
    tiled : bool
        The table holds the tiled layout (:func:`attnquant_kernels.layout.tile_nvfp4`) that
        the model's fused projections read on this CPU.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_dim: int,
        *,
        dtype: DType,
        device: DeviceRef,
        band: NVFP4Band | None = None,
        tiled: bool = False,
    ) -> None:
        super().__init__()
        check_nvfp4_shape((vocab_size, hidden_dim))
        self.vocab_size, self.hidden_dim, self.dtype = vocab_size, hidden_dim, dtype
        self.device, self.tiled = device, tiled
        _hold_packed(self, vocab_size, hidden_dim, device, band)

    def __call__(self, indices: TensorValue) -> TensorValue:
        w, ws, ws2 = (TensorValue(t).to(self.device) for t in self._band)
        ids = TensorValue(indices).to(self.device)
        return gather_nvfp4_rows(w, ws, ws2, ids, self.dtype, tiled=self.tiled)
