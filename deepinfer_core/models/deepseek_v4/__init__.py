"""DeepSeek-V4: the model (`model.py`), its decoder layers (`layers.py`), compressor (`compressor.py`),
rope (`rope.py`), MTP layer (`mtp.py`) and the rows trimmed between layers during exact replay
(`row_trim.py`). Imports contracts, `reference` and the shared parts of `models`.
"""
