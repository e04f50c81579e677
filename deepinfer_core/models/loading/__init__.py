"""Reading checkpoints: files and shards (`checkpoint_files.py`), the official and transformers name
layouts (`checkpoint_layout.py`), loading with tensor-parallel slices (`weights.py`), quantised
formats kept or expanded (`weight_formats.py`) and the MTP layer's weights (`mtp_weights.py`).
Imports contracts and the shared parts of `models`.
"""
