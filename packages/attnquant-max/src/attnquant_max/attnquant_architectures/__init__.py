"""MAX custom-architecture module of attnquant: pass this folder to MAX.

``max serve --custom-architectures <this folder>`` or
``AutoModel(..., custom_architectures=[<this folder>])``; MAX puts the parent on
``sys.path`` and imports this module by its folder name, so it only re-exports
:data:`ARCHITECTURES` from :mod:`attnquant_max._architectures`.
:func:`attnquant_max.architectures_path` returns the folder.
"""

from attnquant_max._architectures import ARCHITECTURES

__all__ = ["ARCHITECTURES"]
