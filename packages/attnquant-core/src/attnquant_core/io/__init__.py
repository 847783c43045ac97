"""Reading and writing checkpoints: safetensors files, Hugging Face checkpoints, the theta format.

* safetensors plumbing: :class:`SafetensorsFiles` (lazy reads), :class:`PlannedWriter` and
  :class:`TensorSpec` (planned, streamed writes), dtype names, tensor digests;
* dense checkpoints: :func:`open_checkpoint`, :class:`Checkpoint`, the projection
  :data:`FAMILIES`;
* the theta checkpoint (``attnquant.json`` plus theta keys): :class:`ThetaCheckpoint` to read,
  :func:`save_theta` and the key and manifest helpers to write, :func:`atomic_directory`
  (:func:`write_atomic` for one file);
* integrity: every tensor's digest, recorded at write, checked at read;
* GGUF: :func:`import_gguf` writes a llama.cpp GGUF as a float32 Hugging Face checkpoint
  (needs the ``gguf`` extra), :func:`export_gguf` a Hugging Face Llama as a float32 GGUF;
* export: :func:`export_nvfp4` writes NVIDIA Model Optimizer's NVFP4 layout of the rebuilt
  weights (``hf_quant_config.json``), for servers that read it.

Depends on :mod:`attnquant_core.forms`, never on :mod:`attnquant_core.fit`.
"""

from ._atomic import atomic_directory, copy_side_files, write_atomic
from ._checkpoint import (
    FAMILIES,
    INDEX_FILE,
    Checkpoint,
    FamilyInfo,
    check_config_dims,
    open_checkpoint,
    parse_projection_key,
    read_tensor_directory,
)
from ._gguf import (
    GGUF_ARCHITECTURES,
    SOURCE_FILE,
    GGUFError,
    ImportProgress,
    dequantize_gguf,
    export_gguf,
    gguf_source,
    gguf_state,
    gguf_tensor_name,
    hf_tensor_key,
    import_gguf,
    permute_rope,
)
from ._integrity import IntegrityReport, check_checkpoint, require_intact
from ._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPED_FORMAT_VERSION,
    MANIFEST_FILE,
    NVFP4_PARTS,
    UNIFORM_FORMAT_VERSION,
    basis_key,
    family_entry,
    is_theta_checkpoint,
    nvfp4_bytes,
    nvfp4_key,
    shared_key,
    stored_of,
    theta_key,
)
from ._modelopt import (
    HF_QUANT_CONFIG_FILE,
    ExportProgress,
    config_quantization,
    export_nvfp4,
    hf_quant_config,
    nvfp4_specs,
)
from ._safetensors import (
    DIGEST_ALGORITHM,
    DIGESTS_FILE,
    PlannedWriter,
    SafetensorsFiles,
    TensorSpec,
    dtype_from_name,
    dtype_name,
    is_float,
    read_digests,
    tensor_digest,
    verify_by_default,
)
from ._theta_read import ThetaCheckpoint
from ._theta_write import family_specs, family_tensors, save_theta

__all__ = [
    # GGUF
    "GGUF_ARCHITECTURES",
    "GGUFError",
    "ImportProgress",
    "SOURCE_FILE",
    "dequantize_gguf",
    "export_gguf",
    "gguf_source",
    "gguf_state",
    "gguf_tensor_name",
    "hf_tensor_key",
    "import_gguf",
    "permute_rope",
    # safetensors files
    "PlannedWriter",
    "SafetensorsFiles",
    "TensorSpec",
    "dtype_from_name",
    "dtype_name",
    "is_float",
    # digests and integrity
    "DIGESTS_FILE",
    "DIGEST_ALGORITHM",
    "IntegrityReport",
    "check_checkpoint",
    "read_digests",
    "require_intact",
    "tensor_digest",
    "verify_by_default",
    # dense checkpoints
    "FAMILIES",
    "INDEX_FILE",
    "Checkpoint",
    "FamilyInfo",
    "check_config_dims",
    "open_checkpoint",
    "parse_projection_key",
    "read_tensor_directory",
    # the theta checkpoint
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GROUPED_FORMAT_VERSION",
    "NVFP4_PARTS",
    "UNIFORM_FORMAT_VERSION",
    "MANIFEST_FILE",
    "ThetaCheckpoint",
    "atomic_directory",
    "basis_key",
    "copy_side_files",
    "family_entry",
    "family_specs",
    "family_tensors",
    "is_theta_checkpoint",
    "nvfp4_bytes",
    "nvfp4_key",
    "save_theta",
    "shared_key",
    "stored_of",
    "theta_key",
    # Model Optimizer's NVFP4 checkpoint (export)
    "HF_QUANT_CONFIG_FILE",
    "ExportProgress",
    "config_quantization",
    "export_nvfp4",
    "hf_quant_config",
    "nvfp4_specs",
    "write_atomic",
]
