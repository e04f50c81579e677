"""DeepSeek-V4.1: the model (`model.py`), its config (`config.py`, `release.py`), layer plan
(`plan.py`), modules (`modules.py`, `compressor.py`), Engram (`engram.py`, `engram_prefetch.py`),
decoder-side trimming (`trim.py`), the vision tower and the image span's layout (`vision.py`,
`vision_tower.py`) and its checkpoint reader (`weights.py`). Imports contracts,
`reference`, `models.deepseek_v4` (shared layers) and the shared parts of `models`.
"""
