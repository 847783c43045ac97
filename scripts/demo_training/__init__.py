"""The code that trains attnquant's embedded demo model and ``models/coder-256x8``.

``scripts/train_demo_model.py`` is its entry point (run it in a throwaway venv with torch, see
its docstring). Modules by role: :mod:`.corpus` (stdlib corpus, splits, BPE tokenizer),
:mod:`.model` (a plain-PyTorch Llama), :mod:`.train` (the training loop), :mod:`.checkpoint`
and :mod:`.card` (the Hugging Face checkpoint, ``training.json`` and ``MODEL_CARD.md``) and
:mod:`.pipeline` (the steps in order). Not part of any package: no wheel ships it.
"""
